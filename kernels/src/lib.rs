//! The CUDA kernels of candle-twell as PTX text, one constant per `src/*.cu` file (the
//! build script compiles them with nvcc). The ops that launch them live in the crates
//! that own each idea: the TwELL MLP in `twell`, the transformer ops in `fused-ops`.
//! Each constant is a module for `CudaDevice::get_or_load_custom_func`.

pub const ADAMW: &str = include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx"));
pub const ADD_RMS_NORM: &str = include_str!(concat!(env!("OUT_DIR"), "/add_rms_norm.ptx"));
pub const ARGMAX: &str = include_str!(concat!(env!("OUT_DIR"), "/argmax.ptx"));
pub const ATTENTION_SOFTMAX_GRAD: &str =
    include_str!(concat!(env!("OUT_DIR"), "/attention_softmax_grad.ptx"));
pub const CAUSAL_ATTENTION: &str = include_str!(concat!(env!("OUT_DIR"), "/causal_attention.ptx"));
/// `causal_attention.cu` built for sm_90a: its wgmma kernel, for compute capability 9.0.
pub const CAUSAL_ATTENTION_SM90A: &str =
    include_str!(concat!(env!("OUT_DIR"), "/causal_attention_sm90a.ptx"));
pub const CROSS_ENTROPY: &str = include_str!(concat!(env!("OUT_DIR"), "/cross_entropy.ptx"));
pub const EMBEDDING: &str = include_str!(concat!(env!("OUT_DIR"), "/embedding.ptx"));
pub const FILL: &str = include_str!(concat!(env!("OUT_DIR"), "/fill.ptx"));
pub const GATE_L0: &str = include_str!(concat!(env!("OUT_DIR"), "/gate_l0.ptx"));
pub const GATE_PACK: &str = include_str!(concat!(env!("OUT_DIR"), "/gate_pack.ptx"));
pub const GATED_T2D: &str = include_str!(concat!(env!("OUT_DIR"), "/gated_t2d.ptx"));
pub const KL_DIVERGENCE: &str = include_str!(concat!(env!("OUT_DIR"), "/kl_divergence.ptx"));
pub const LINEAR_ROWS: &str = include_str!(concat!(env!("OUT_DIR"), "/linear_rows.ptx"));
pub const ROPE: &str = include_str!(concat!(env!("OUT_DIR"), "/rope.ptx"));
pub const TWELL_MLP_BWD: &str = include_str!(concat!(env!("OUT_DIR"), "/twell_mlp_bwd.ptx"));
pub const TWELL_MLP_DECODE: &str = include_str!(concat!(env!("OUT_DIR"), "/twell_mlp_decode.ptx"));
pub const TWELL_MLP_PRODUCTS: &str =
    include_str!(concat!(env!("OUT_DIR"), "/twell_mlp_products.ptx"));

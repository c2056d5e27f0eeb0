//! [`SparseMlp`]: a gated MLP that runs dense or through TwELL, as a `candle_nn::Module`.
//!
//! It loads the HF weights `gate_proj`, `up_proj` and `down_proj` and computes
//! `down(act(gate(x)) ⊙ up(x))`. With a ReLU gate it can take the sparse path, which
//! gives the same result (up to rounding) while touching only the active neurons.

use std::sync::{Arc, Mutex, OnceLock};

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::VarBuilder;

use crate::auto::{Entry, Side, AUTO_RECHECK_CALLS};
use crate::cpu::screen::{GateScreen, SCREEN_MAX_DENSITY, SCREEN_MAX_ROWS};
use crate::error::{err, TwellError};
use crate::format::{KernelPaths, StagedRows, TwellConfig};
use crate::{twell_mlp_screened, twell_mlp_with_backward_path, up_down_matrix, BackwardPath};

/// Not a trainable variable nor part of an autograd graph: a copy made of it once
/// stays valid.
mod choice;
pub mod quantized;

fn frozen(t: &Tensor) -> bool {
    !t.is_variable() && !t.track_op()
}

/// Which computation the MLP runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FfnMode {
    /// Three dense matmuls: the reference.
    Dense,
    /// Gate GEMM + ReLU + TwELL pack, then the sparse up/down projections.
    Sparse,
    /// Sparse while the measured density stays below the break-even, dense above it (on
    /// a GPU, for inference, dense by [`crate::twell_mlp_products`]).
    #[default]
    Auto,
}

impl FfnMode {
    /// The lowercase name that [`FfnMode::from_str`](std::str::FromStr) reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Sparse => "sparse",
            Self::Auto => "auto",
        }
    }
}

impl std::fmt::Display for FfnMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FfnMode {
    type Err = TwellError;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "dense" => Ok(Self::Dense),
            "sparse" => Ok(Self::Sparse),
            "auto" => Ok(Self::Auto),
            other => Err(TwellError::Invalid(format!(
                "unknown FFN mode '{other}' (want dense, sparse or auto)"
            ))),
        }
    }
}

/// The gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU, as pretrained Llama models ship.
    Silu,
    /// ReGLU: exact zeros, so the sparse path applies.
    Relu,
}

impl Activation {
    /// From an HF config's `hidden_act`.
    pub fn from_hf(name: &str) -> Result<Self> {
        match name {
            "silu" | "swish" => Ok(Self::Silu),
            "relu" => Ok(Self::Relu),
            other => err(TwellError::Invalid(format!(
                "unsupported hidden_act '{other}' (want silu or relu)"
            ))),
        }
    }

    /// The HF `hidden_act` name.
    pub fn hf_name(&self) -> &'static str {
        match self {
            Self::Silu => "silu",
            Self::Relu => "relu",
        }
    }

    fn apply(&self, t: &Tensor) -> Result<Tensor> {
        match self {
            Self::Silu => candle_nn::ops::silu(t),
            Self::Relu => t.relu(),
        }
    }
}

/// Rows of `x` (all dimensions but the last).
fn rows(x: &Tensor) -> usize {
    x.dims().last().map_or(0, |&d| x.elem_count() / d.max(1))
}

/// The per-token sparsity term that [`SparseMlp::forward_with_l1`] returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum L1Term {
    /// `Σ_j |h_j|`, as in the paper; computed on either path.
    #[default]
    Plain,
    /// `Σ_j φ(z_j)` with `z_j = relu(g_j)·√d / (‖x‖·‖Wg_j‖)` (the gate as a cosine,
    /// scaled to unit spread) and `φ(z) = z / (z + ε)`, ε = [`GATE_L0_EPS`]: a smooth
    /// count of the positive gates. Scaling `x` or a gate row changes nothing, and its
    /// pull, `ε / (z + ε)²`, is strongest on the gates just above zero, the ones that
    /// need the least to switch off; the large ones are barely touched. Dense path only.
    GateL0,
}

/// ε of [`L1Term::GateL0`], in units of a gate's spread (`z` of a random gate is about
/// a standard normal): a gate at z = ε counts one half. The fine-tune recipe's value
/// (docs/finetuning.md): 0.1 trained the same, 0.03 worse.
pub const GATE_L0_EPS: f64 = 0.3;

/// Which path the last forward took and what it saw.
#[derive(Clone, Debug)]
pub struct MlpStats {
    pub tokens: usize,
    pub ffn: usize,
    /// Mean nonzeros of `h` per token (L0).
    pub mean_l0: f64,
    /// `mean_l0 / ffn`.
    pub density: f64,
    /// `(token, tile)` pairs that overflowed the TwELL capacity (sparse path only).
    pub overflow_tiles: usize,
    /// Tokens with at least one overflowing tile (sparse path only).
    pub overflow_rows: usize,
    /// How often each neuron fired in this forward (`[ffn]`), for dead-neuron counts;
    /// empty after a CUDA forward, which counts per tile only.
    pub fired: Vec<u32>,
    /// Whether the forward ran the TwELL kernels (else candle's dense MLP, or on a GPU
    /// `Auto`'s dense side, [`crate::twell_mlp_products`], whose tile counts fill
    /// the overflow fields all the same).
    pub sparse: bool,
}

impl MlpStats {
    /// `sparse`: whether the TwELL kernels ran (not [`crate::twell_mlp_products`]).
    fn from_output(res: &crate::MlpOutput, sparse: bool) -> Result<Self> {
        let (tokens, ffn) = (res.out.dim(0)?, res.ffn);
        let nnz = res.nnz()?;
        let (overflow_tiles, overflow_rows) = res.overflow()?;
        Ok(Self {
            tokens,
            ffn,
            mean_l0: nnz as f64 / tokens.max(1) as f64,
            density: nnz as f64 / (tokens * ffn).max(1) as f64,
            overflow_tiles,
            overflow_rows,
            fired: res.fired_per_neuron().unwrap_or_default(),
            sparse,
        })
    }

    fn from_dense(h: &Tensor) -> Result<Self> {
        let (tokens, ffn) = h.dims2()?;
        let fired = h.ne(0.0)?.to_dtype(DType::U32)?.sum(0)?.to_vec1::<u32>()?;
        let nnz: u64 = fired.iter().map(|&c| c as u64).sum();
        Ok(Self {
            tokens,
            ffn,
            mean_l0: nnz as f64 / tokens.max(1) as f64,
            density: nnz as f64 / (tokens * ffn).max(1) as f64,
            overflow_tiles: 0,
            overflow_rows: 0,
            fired,
            sparse: false,
        })
    }
}

/// Nonzeros of the `[M, f]` activations `h`, counted on their device with one read-back.
/// This runs on `Auto`'s periodic re-measure of a dense pass, so it must stay cheap: per
/// row counts over blocks of rows (an f32 mask of a whole 65k-token pass would take
/// 1.5 GB), added in f64 (exact). The per-neuron counts of [`MlpStats`] summed over the
/// rows, a strided reduction, cost about 4 ms at 1,024 tokens on the H200 (25 dense
/// passes), which put `Auto` below dense in the benchmark (docs/benchmarks.md).
fn count_nonzero(h: &Tensor) -> Result<u64> {
    const ROWS: usize = 4096;
    let m = h.dim(0)?;
    let per_row = (0..m)
        .step_by(ROWS)
        .map(|start| {
            let block = h.narrow(0, start, ROWS.min(m - start))?;
            block.ne(0.0)?.to_dtype(DType::F32)?.sum(1)
        })
        .collect::<Result<Vec<_>>>()?;
    if per_row.is_empty() {
        return Ok(0);
    }
    let total = Tensor::cat(&per_row, 0)?
        .to_dtype(DType::F64)?
        .sum_all()?
        .to_scalar::<f64>()?;
    Ok(total as u64)
}

/// What the sparse path leaves behind to be turned into [`MlpStats`] on request.
enum LastForward {
    Sparse(crate::MlpOutput),
    /// `Auto`'s dense side on a GPU ([`crate::twell_mlp_products`]).
    Products(crate::MlpOutput),
    Dense(Tensor),
    /// The quantized CPU path ([`SparseMlp::quantize_for_cpu`]): its counts only.
    Counted {
        rows: usize,
        nonzeros: u64,
        sparse: bool,
        fired: Vec<u32>,
    },
}

/// A gated MLP (`gate_proj`, `up_proj`, `down_proj`, no biases) with a dense and a
/// TwELL-sparse path.
pub struct SparseMlp {
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    /// `[f, 2d]` neuron-major up/down, built once for inference.
    up_down: OnceLock<Tensor>,
    /// The trainable `[f, 2d]` up/down matrix when the weights are stored that way
    /// ([`SparseMlp::from_up_down`]); `up` and `down` are then views of it.
    fused: Option<Tensor>,
    /// The int8 screen of `gate` for host decoding, built on first use.
    gate_screen: OnceLock<Arc<GateScreen>>,
    use_gate_screen: bool,
    activation: Activation,
    mode: FfnMode,
    config: TwellConfig,
    /// `None`: the device's default break-even.
    break_even: Option<f64>,
    record_stats: bool,
    /// `None`: the backward path follows the measured density.
    backward_path: Option<BackwardPath>,
    /// The per-token sparsity term (see [`SparseMlp::set_l1_term`]).
    l1_term: L1Term,
    calls: std::sync::atomic::AtomicUsize,
    /// `Auto` re-measures the density every this many calls (0: only when unknown).
    recheck_calls: usize,
    /// The side the last call ran ([`SparseMlp::last_side`]).
    last_side: Mutex<Option<Side>>,
    last: Mutex<Option<LastForward>>,
    /// The last measured density, and the rows it was measured on.
    last_density: Mutex<Option<(f64, usize)>>,
    /// After [`SparseMlp::fold_pre_norm`]: the unit weight `[d]` of the norm before the
    /// MLP, whose own weight now sits in `gate` and `up`.
    unit_pre_norm: Option<Tensor>,
    /// HF `mlp_bias` (see [`SparseMlp::with_bias`]).
    bias: Option<MlpBias>,
    /// Quantized rows that CPU inference runs on ([`SparseMlp::quantize_for_cpu`]).
    quantized: Option<Arc<quantized::QuantizedMlp>>,
    /// The f32 weights were let go ([`SparseMlp::release_f32_weights`]).
    f32_released: bool,
    /// Every forward's input rows, while asked for ([`SparseMlp::set_keep_inputs`]).
    kept_inputs: Option<Mutex<Vec<Tensor>>>,
}

/// The biases of the three projections (HF Llama's `mlp_bias`): `gate [f]`, `up [f]`,
/// `down [d]`. Why a model would want them: a gate bias is a per-neuron threshold the
/// optimizer can lower directly to switch a neuron off, instead of turning the gate's
/// weights away from the inputs.
#[derive(Clone, Debug)]
pub struct MlpBias {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

impl MlpBias {
    /// Loads `gate_proj.bias`, `up_proj.bias` and `down_proj.bias` (HF names).
    pub fn load(vb: &VarBuilder, hidden: usize, ffn: usize) -> Result<Self> {
        Ok(Self {
            gate: vb.pp("gate_proj").get(ffn, "bias")?,
            up: vb.pp("up_proj").get(ffn, "bias")?,
            down: vb.pp("down_proj").get(hidden, "bias")?,
        })
    }
}

impl std::fmt::Debug for SparseMlp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SparseMlp")
            .field("hidden", &self.hidden())
            .field("ffn", &self.ffn())
            .field("activation", &self.activation)
            .field("mode", &self.mode)
            .finish()
    }
}

impl SparseMlp {
    /// From HF-layout weights `gate [f, d]`, `up [f, d]`, `down [d, f]`.
    pub fn new(
        gate: Tensor,
        up: Tensor,
        down: Tensor,
        activation: Activation,
        mode: FfnMode,
    ) -> Result<Self> {
        let (f, d) = fused_ops::checks::matrix_dims("gate_proj", &gate)?;
        for (name, t, want) in [("up_proj", &up, (f, d)), ("down_proj", &down, (d, f))] {
            let got = fused_ops::checks::matrix_dims(name, t)?;
            if got != want {
                return err(TwellError::ShapeMismatch {
                    what: "SparseMlp",
                    detail: format!(
                        "{name} is {got:?}, expected {want:?} for gate_proj [{f}, {d}]"
                    ),
                });
            }
            fused_ops::checks::same_dtype_and_device("SparseMlp", &gate, t)?;
        }
        if mode == FfnMode::Sparse && activation == Activation::Silu {
            return err(TwellError::SparseNeedsRelu);
        }
        Ok(Self {
            gate,
            up,
            down,
            up_down: OnceLock::new(),
            fused: None,
            gate_screen: OnceLock::new(),
            use_gate_screen: true,
            activation,
            mode,
            config: TwellConfig::default(),
            break_even: None,
            record_stats: false,
            backward_path: None,
            l1_term: L1Term::Plain,
            calls: std::sync::atomic::AtomicUsize::new(0),
            recheck_calls: AUTO_RECHECK_CALLS,
            last_side: Mutex::new(None),
            last: Mutex::new(None),
            last_density: Mutex::new(None),
            unit_pre_norm: None,
            bias: None,
            quantized: None,
            f32_released: false,
            kept_inputs: None,
        })
    }

    /// Adds the projections' biases. The TwELL kernels do not apply biases: a biased
    /// MLP runs dense (`Auto` decides dense every call; `Sparse` is refused here and in
    /// [`SparseMlp::set_mode`]).
    pub fn with_bias(mut self, bias: MlpBias) -> Result<Self> {
        let (f, d) = (self.ffn(), self.hidden());
        for (name, t, want) in [
            ("gate_proj.bias", &bias.gate, f),
            ("up_proj.bias", &bias.up, f),
            ("down_proj.bias", &bias.down, d),
        ] {
            if t.dims() != [want] {
                return err(TwellError::ShapeMismatch {
                    what: "SparseMlp::with_bias",
                    detail: format!("{name} is {:?}, expected [{want}]", t.dims()),
                });
            }
            fused_ops::checks::same_dtype_and_device("SparseMlp::with_bias", &self.gate, t)?;
        }
        if self.mode == FfnMode::Sparse {
            return err(TwellError::SparseBias);
        }
        self.bias = Some(bias);
        Ok(self)
    }

    /// Loads `gate_proj`, `up_proj`, `down_proj` from a VarBuilder (HF names).
    pub fn load(
        vb: VarBuilder,
        hidden: usize,
        ffn: usize,
        activation: Activation,
        mode: FfnMode,
    ) -> Result<Self> {
        let gate = vb.pp("gate_proj").get((ffn, hidden), "weight")?;
        if vb.contains_tensor("up_down.weight") {
            let up_down = vb.pp("up_down").get((ffn, 2 * hidden), "weight")?;
            return Self::from_up_down(gate, up_down, activation, mode);
        }
        let up = vb.pp("up_proj").get((ffn, hidden), "weight")?;
        let down = vb.pp("down_proj").get((hidden, ffn), "weight")?;
        Self::new(gate, up, down, activation, mode)
    }

    /// From `gate [f, d]` and the neuron-major `up_down [f, 2d]` ([`up_down_matrix`]'s
    /// layout, row j: `up_proj` row j, then `down_proj` column j) as the stored weight.
    /// Training the TwELL path on it saves, per call, the copy that builds that matrix
    /// from separate `up` and `down` and the strided adds that split its gradient; the
    /// dense path copies `up` and `down` out of it instead.
    pub fn from_up_down(
        gate: Tensor,
        up_down: Tensor,
        activation: Activation,
        mode: FfnMode,
    ) -> Result<Self> {
        let (f, d) = fused_ops::checks::matrix_dims("gate_proj", &gate)?;
        let got = fused_ops::checks::matrix_dims("up_down", &up_down)?;
        if got != (f, 2 * d) {
            return err(TwellError::ShapeMismatch {
                what: "SparseMlp::from_up_down",
                detail: format!(
                    "up_down is {got:?}, expected ({f}, {}) for gate_proj [{f}, {d}]",
                    2 * d
                ),
            });
        }
        let up = up_down.narrow(1, 0, d)?;
        let down = up_down.narrow(1, d, d)?.t()?;
        let mut mlp = Self::new(gate, up, down, activation, mode)?;
        mlp.fused = Some(up_down);
        Ok(mlp)
    }

    pub fn with_twell_config(mut self, config: TwellConfig) -> Self {
        self.config = config;
        self
    }

    /// Fixes the CUDA backward's path ([`BackwardPath`]) instead of choosing it by the
    /// measured density: to time the paths against each other.
    pub fn with_backward_path(mut self, path: BackwardPath) -> Self {
        self.backward_path = Some(path);
        self
    }

    /// Sets the density above which `Auto` runs dense.
    pub fn with_break_even(mut self, density: f64) -> Self {
        self.break_even = Some(density);
        self
    }

    /// Whether few-token host passes may use the int8 gate screen (on by default; the
    /// result is the same either way, only the speed differs).
    pub fn with_gate_screen(mut self, on: bool) -> Self {
        self.use_gate_screen = on;
        self
    }

    /// How often `Auto` re-measures the density (every `calls` calls; 0: only while none
    /// is known), so that a change of text moves it to another side. On a GPU each
    /// measurement reads a count back, a sync; a server whose traffic is steady can
    /// measure less often. Default [`AUTO_RECHECK_CALLS`].
    pub fn with_density_recheck(mut self, calls: usize) -> Self {
        self.recheck_calls = calls;
        self
    }

    /// Keep what the last forward saw, for [`SparseMlp::last_stats`]. Off by default:
    /// on the dense path it costs an extra pass over `h`.
    pub fn with_stats(mut self, on: bool) -> Self {
        self.record_stats = on;
        self
    }

    /// Chooses the per-token term that [`SparseMlp::forward_with_l1`] returns.
    ///
    /// Why not always `Σ_j |h_j|`: a ReLU MLP computes the same function after
    /// `Wg_j → a·Wg_j`, `Wu_j → b·Wu_j`, `Wd_j → Wd_j/(a·b)` (a, b > 0), which scales
    /// `h_j` by `a·b`. The plain term can therefore be lowered by shrinking `h` and
    /// growing `Wd`, without a single new zero. [`L1Term::GateL0`] counts the positive
    /// gates instead, each read as a cosine, which no rescaling changes. It is computed
    /// on the dense path only (the TwELL kernels compute the plain term).
    pub fn set_l1_term(&mut self, term: L1Term) {
        self.l1_term = term;
    }

    pub fn set_mode(&mut self, mode: FfnMode) -> Result<()> {
        if mode == FfnMode::Sparse && self.activation == Activation::Silu {
            return err(TwellError::SparseNeedsRelu);
        }
        if mode == FfnMode::Sparse && self.bias.is_some() {
            return err(TwellError::SparseBias);
        }
        self.mode = mode;
        Ok(())
    }

    pub fn mode(&self) -> FfnMode {
        self.mode
    }
    pub fn activation(&self) -> Activation {
        self.activation
    }
    /// Whether the MLP has biases (which the sparse path does not take).
    pub fn has_bias(&self) -> bool {
        self.bias.is_some()
    }
    /// Whether each forward keeps its statistics ([`Self::set_record_stats`]).
    pub fn records_stats(&self) -> bool {
        self.record_stats
    }
    pub fn hidden(&self) -> usize {
        self.gate.dim(1).unwrap_or(0)
    }
    pub fn ffn(&self) -> usize {
        self.gate.dim(0).unwrap_or(0)
    }
    pub fn gate_proj(&self) -> &Tensor {
        &self.gate
    }
    pub fn up_proj(&self) -> &Tensor {
        &self.up
    }
    pub fn down_proj(&self) -> &Tensor {
        &self.down
    }
    /// The TwELL tiling and kernel choices its sparse path runs with.
    pub fn twell_config(&self) -> TwellConfig {
        self.config
    }

    /// The neuron-major `[f, 2d]` up/down matrix: rebuilt (differentiably) when the
    /// weights are trainable variables, built once otherwise.
    fn up_down(&self) -> Result<Tensor> {
        if let Some(w) = &self.fused {
            return Ok(w.clone());
        }
        if !frozen(&self.up) || !frozen(&self.down) {
            return up_down_matrix(&self.up, &self.down);
        }
        if let Some(w) = self.up_down.get() {
            return Ok(w.clone());
        }
        let w = up_down_matrix(&self.up, &self.down)?;
        // One-token passes read scattered rows of it (and of the gate, below).
        crate::cpu::huge_pages::collapse(&w);
        Ok(self.up_down.get_or_init(|| w).clone())
    }

    /// Runs CPU inference through quantized copies of the three projections (see
    /// [`quantized`]): the sparse path where the activation is ReLU and the mode is not
    /// `Dense`, else the dense one. The f32 paths' inference copies (the up/down matrix,
    /// the gate screen) are dropped; training passes still take the f32 weights.
    pub fn quantize_for_cpu(&mut self, format: crate::cpu::quant::QuantFormat) -> Result<()> {
        if !self.gate.device().is_cpu() {
            return err(TwellError::Invalid(
                "quantize_for_cpu: the quantized MLP runs on the CPU only".into(),
            ));
        }
        if self.bias.is_some() {
            return err(TwellError::Invalid(
                "quantize_for_cpu: an MLP with biases has no quantized path".into(),
            ));
        }
        let sparse = self.activation == Activation::Relu && self.mode != FfnMode::Dense;
        self.quantized = Some(Arc::new(quantized::QuantizedMlp::quantize(
            &self.gate,
            &self.up,
            &self.down,
            self.activation,
            sparse,
            format,
        )?));
        self.up_down = OnceLock::new();
        self.gate_screen = OnceLock::new();
        Ok(())
    }

    /// Lets the f32 weights go after [`SparseMlp::quantize_for_cpu`], keeping their
    /// shapes: a quantized model then holds its quantized rows alone. Every later call
    /// must be CPU inference (anything else is refused).
    pub fn release_f32_weights(&mut self) -> Result<()> {
        if self.quantized.is_none() {
            return err(TwellError::Invalid(
                "release_f32_weights: call quantize_for_cpu first".into(),
            ));
        }
        let placeholder =
            |w: &Tensor| Tensor::zeros((), w.dtype(), w.device())?.broadcast_as(w.shape());
        self.gate = placeholder(&self.gate)?;
        self.up = placeholder(&self.up)?;
        self.down = placeholder(&self.down)?;
        self.fused = None;
        self.f32_released = true;
        Ok(())
    }

    /// Whether [`SparseMlp::quantize_for_cpu`] has run.
    pub fn is_quantized(&self) -> bool {
        self.quantized.is_some()
    }

    /// The side a call on `x` runs through the quantized rows, if it does: inference
    /// (no L1 term asked) on the CPU, after [`SparseMlp::quantize_for_cpu`].
    fn quantized_side(&self, x: &Tensor, want_l1: bool) -> Option<Side> {
        let q = self.quantized.as_ref()?;
        if want_l1 || !x.device().is_cpu() {
            return None;
        }
        Some(if q.is_sparse() {
            Side::Sparse
        } else {
            Side::Dense
        })
    }

    fn run_quantized(&self, q: &quantized::QuantizedMlp, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let rows = x.elem_count() / q.hidden().max(1);
        let res = q.forward(
            &fused_ops::checks::reshaped(x, &[rows, q.hidden()])?,
            self.record_stats,
        )?;
        if self.record_stats {
            *self.last.lock().expect("stats lock") = Some(LastForward::Counted {
                rows,
                nonzeros: res.nonzeros,
                sparse: q.is_sparse(),
                fired: res.fired.unwrap_or_default(),
            });
        }
        Tensor::from_vec(res.out, dims, x.device())
    }

    /// Builds now what a sparse inference pass would build on its first call (the
    /// neuron-major up/down matrix, the host's int8 gate screen), for an MLP that can
    /// run sparse. Otherwise the first token pays for it, and `Auto`, whose timings are
    /// shared by the layers of one shape, would time one layer's build as the sparse
    /// side's cost and pick dense for calls the sparse side wins.
    pub fn prepare_inference(&self) -> Result<()> {
        if self.quantized.is_some()
            || self.mode == FfnMode::Dense
            || self.activation != Activation::Relu
        {
            return Ok(());
        }
        self.up_down()?;
        if self.use_gate_screen && self.gate.device().is_cpu() && frozen(&self.gate) {
            self.screen_for(1)?;
        }
        Ok(())
    }

    /// Whether a sparse pass of `tokens` tokens uses the int8 gate screen: on the host,
    /// for few tokens, below [`SCREEN_MAX_DENSITY`] (near half density nearly every
    /// neuron is a candidate and the screen only adds its own bytes), and only on frozen
    /// weights, as the screen is a copy of them.
    pub fn uses_gate_screen(&self, tokens: usize) -> bool {
        let too_dense = self.last_density().is_some_and(|d| d > SCREEN_MAX_DENSITY);
        self.use_gate_screen
            && !too_dense
            && tokens <= SCREEN_MAX_ROWS
            && self.gate.device().is_cpu()
            && frozen(&self.gate)
    }

    /// The screen for a sparse pass of `tokens` tokens, built on first use.
    fn screen_for(&self, tokens: usize) -> Result<Option<Arc<GateScreen>>> {
        if !self.uses_gate_screen(tokens) {
            return Ok(None);
        }
        if let Some(s) = self.gate_screen.get() {
            return Ok(Some(s.clone()));
        }
        let s = Arc::new(crate::gate_screen(&self.gate)?);
        crate::cpu::huge_pages::collapse(&self.gate);
        Ok(Some(self.gate_screen.get_or_init(|| s).clone()))
    }

    /// The MLP output and each token's L1 term `Σ_j |h_j|` (`[..]`, the leading dims
    /// of `x`), both differentiable.
    pub fn forward_with_l1(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let (out, l1) = self.run(x, true)?;
        Ok((out, l1.expect("l1 requested")))
    }

    /// Sets whether forwards keep their statistics (see [`SparseMlp::with_stats`]).
    pub fn set_record_stats(&mut self, on: bool) {
        self.record_stats = on;
    }

    /// Sets whether every forward keeps a copy of its input rows `[rows, d]` (the MLP's
    /// own input, after the norm before it), until [`Self::take_inputs`]: what a real
    /// model feeds this layer, for benchmarks that time it on real activations. While on,
    /// no add or norm folds into the MLP's launches (their input is another tensor).
    pub fn set_keep_inputs(&mut self, on: bool) {
        self.kept_inputs = on.then(|| Mutex::new(Vec::new()));
    }

    /// The input rows kept since the last call, in call order (empty unless
    /// [`Self::set_keep_inputs`]).
    pub fn take_inputs(&self) -> Vec<Tensor> {
        match &self.kept_inputs {
            Some(kept) => std::mem::take(&mut *kept.lock().expect("kept inputs lock")),
            None => Vec::new(),
        }
    }

    /// The MLP of `x` and the residual add and RMS norm after it, as a Llama block runs
    /// them: `(residual + mlp(x), rms_norm(residual + mlp(x)) · alpha)` (`alpha [d]`, the
    /// next norm's weight). Inference on the sparse CUDA path folds the add and the norm
    /// into the MLP's last launch, for one token and for prefill rows
    /// ([`crate::twell_mlp_add_norm`], the same arithmetic up to the order of f32
    /// sums); everything else is [`Module::forward`] then [`fused_ops::add_rms_norm`].
    pub fn forward_add_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        alpha: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        let measure = self.measure_now(x.device(), rows(x));
        let (side, timer) = self.pick(x, Entry::AddNorm, false, measure)?;
        let measure = measure || self.measures_free(x.device(), side);
        self.timed(x.device(), timer, || {
            self.add_norm_on(side, x, residual, (alpha, eps), measure)
        })
    }

    /// Folds the weight `alpha [d]` of the RMS norm before this MLP into `gate` and `up`
    /// (each column k scaled by `alpha[k]`, in f32, then rounded to the weights' dtype),
    /// so that the norm's own weight becomes one: `mlp(rms_norm(s) · alpha)` is then
    /// `mlp(rms_norm(s))`. The caller gives that norm a unit weight (the model's
    /// `fold_mlp_norms`). Why: the norm's factor per row is then a positive scalar, which
    /// the sparse prefill applies inside its kernels
    /// ([`SparseMlp::forward_sublayer_from_sum`]), so the normalised rows are never
    /// written. For inference on frozen weights; once per MLP.
    pub fn fold_pre_norm(&mut self, alpha: &Tensor) -> Result<()> {
        let d = self.hidden();
        if alpha.dims() != [d] {
            return err(TwellError::ShapeMismatch {
                what: "SparseMlp::fold_pre_norm",
                detail: format!("alpha is {:?}, expected [{d}]", alpha.dims()),
            });
        }
        fused_ops::checks::same_dtype_and_device("SparseMlp::fold_pre_norm", &self.gate, alpha)?;
        if self.unit_pre_norm.is_some() {
            return err(TwellError::Invalid(
                "SparseMlp::fold_pre_norm: the norm's weight is folded in already".into(),
            ));
        }
        if [&self.gate, &self.up, &self.down]
            .into_iter()
            .any(|w| !frozen(w))
        {
            return err(TwellError::Invalid(
                "SparseMlp::fold_pre_norm is for inference: the weights are trainable".into(),
            ));
        }
        let scale = alpha.to_dtype(DType::F32)?;
        let fold = |w: &Tensor| -> Result<Tensor> {
            w.to_dtype(DType::F32)?
                .broadcast_mul(&scale)?
                .to_dtype(w.dtype())
        };
        self.gate = fold(&self.gate)?;
        self.up = fold(&self.up)?;
        // A view of a stored up/down matrix would keep that whole matrix alive.
        self.down = self.down.contiguous()?;
        self.fused = None;
        self.up_down = OnceLock::new();
        self.gate_screen = OnceLock::new();
        self.unit_pre_norm = Some(alpha.ones_like()?);
        Ok(())
    }

    /// Whether [`SparseMlp::fold_pre_norm`] has run.
    pub fn pre_norm_folded(&self) -> bool {
        self.unit_pre_norm.is_some()
    }

    /// The MLP sublayer from the residual sum `s` (the attention's output already added,
    /// see `ops::residual_add_linear`), after [`SparseMlp::fold_pre_norm`]: returns
    /// `(out, rms_norm(out) · alpha)` with `out = s + mlp(rms_norm(s))` (unit weight,
    /// `pre_eps`; `alpha`, `eps`: the next norm). Prefill rows on the sparse CUDA path run
    /// as [`crate::twell_mlp_norm_add_norm`]: the gate GEMM reads `s` and the up
    /// kernel normalises its rows in registers. Elsewhere: [`fused_ops::rms_norm`],
    /// then [`SparseMlp::forward_add_norm`]'s path.
    pub fn forward_sublayer_from_sum(
        &self,
        s: &Tensor,
        pre_eps: f64,
        (alpha, eps): (&Tensor, f64),
    ) -> Result<(Tensor, Tensor)> {
        let Some(unit) = &self.unit_pre_norm else {
            return err(TwellError::Invalid(
                "SparseMlp::forward_sublayer_from_sum needs the norm's weight folded in \
                 (fold_pre_norm)"
                    .into(),
            ));
        };
        let measure = self.measure_now(s.device(), rows(s));
        let (side, timer) = self.pick(s, Entry::SublayerFromSum, false, measure)?;
        let measure = measure || self.measures_free(s.device(), side);
        self.timed(s.device(), timer, || {
            let fold = self.add_norm_fold(side, s, s, &[alpha], measure);
            if let Some(config) = fold.filter(|&c| crate::norm_add_norm_runs(s, self.ffn(), c)) {
                let d = self.hidden();
                let rows = fused_ops::checks::reshaped(s, &[s.elem_count() / d, d])?;
                let (sum, normed) = crate::twell_mlp_norm_add_norm(
                    &rows,
                    &self.gate,
                    &self.up_down()?,
                    config,
                    pre_eps,
                    (alpha, eps),
                )?;
                return Ok((
                    fused_ops::checks::reshaped(&sum, s.dims())?,
                    fused_ops::checks::reshaped(&normed, s.dims())?,
                ));
            }
            let normed = fused_ops::rms_norm(s, unit, pre_eps)?;
            self.add_norm_on(side, &normed, s, (alpha, eps), measure)
        })
    }

    /// The whole MLP sublayer of a pre-norm (Llama) block, from the previous sublayer's
    /// output `y`: with `h = residual + y`, returns `(out, rms_norm(out) · alpha)` where
    /// `out = h + mlp(rms_norm(h) · pre_alpha)` (`pre_alpha`, this sublayer's norm;
    /// `alpha`, the next one's). One token of inference on the sparse CUDA path runs it
    /// as one launch, the same arithmetic as the three steps (up to the order of the
    /// MLP's f32 atomic sums); everything else is
    /// [`fused_ops::add_rms_norm`], then [`Self::forward_add_norm`].
    pub fn forward_sublayer(
        &self,
        residual: &Tensor,
        y: &Tensor,
        (pre_alpha, pre_eps): (&Tensor, f64),
        (alpha, eps): (&Tensor, f64),
    ) -> Result<(Tensor, Tensor)> {
        let measure = self.measure_now(y.device(), rows(y));
        let (side, timer) = self.pick(y, Entry::Sublayer, false, measure)?;
        let measure = measure || self.measures_free(y.device(), side);
        self.timed(y.device(), timer, || {
            let fold = match y.elem_count() == self.hidden() {
                true => self.add_norm_fold(side, y, residual, &[pre_alpha, alpha], measure),
                false => None,
            };
            if let Some(config) = fold {
                let pre = Some((pre_alpha, pre_eps));
                return self.folded_add_norm(y, residual, config, (alpha, eps), pre);
            }
            let (h, normed) = fused_ops::add_rms_norm(residual, y, pre_alpha, pre_eps)?;
            self.add_norm_on(side, &normed, &h, (alpha, eps), measure)
        })
    }

    /// [`Self::forward_add_norm`] on `side`, where the caller has asked
    /// [`Self::measure_now`].
    fn add_norm_on(
        &self,
        side: Side,
        x: &Tensor,
        residual: &Tensor,
        (alpha, eps): (&Tensor, f64),
        measure: bool,
    ) -> Result<(Tensor, Tensor)> {
        if let Some(config) = self.add_norm_fold(side, x, residual, &[alpha], measure) {
            return self.folded_add_norm(x, residual, config, (alpha, eps), None);
        }
        let (out, _) = self.run_on(side, x, false, measure)?;
        fused_ops::add_rms_norm(residual, &out, alpha, eps)
    }

    /// Where a call on `x` (and `residual`, and the norm weights) on `side` runs as the one
    /// launch, the configuration it runs with ([`Self::kernel_config`]): not while
    /// measuring or recording (those read the packed activations), not under autograd (the
    /// launch has no backward), on the sparse path.
    fn add_norm_fold(
        &self,
        side: Side,
        x: &Tensor,
        residual: &Tensor,
        alphas: &[&Tensor],
        measure: bool,
    ) -> Option<TwellConfig> {
        let d = x.dims().last().copied().unwrap_or(0);
        let config = self.kernel_config(x);
        let folds = !measure
            && !self.record_stats
            && self.kept_inputs.is_none()
            && crate::add_norm_fuses(x, self.ffn(), config)
            && d == self.hidden()
            && residual.dims() == x.dims()
            && [x, residual, &self.gate, &self.up, &self.down]
                .into_iter()
                .chain(alphas.iter().copied())
                .all(|t| !t.track_op())
            && side == Side::Sparse;
        folds.then_some(config)
    }

    /// The TwELL configuration of a call on `x`: `StagedRows::Auto` settled by the density
    /// last measured ([`crate::staged_rows_for`]), so that the kernels a call runs and the
    /// checks of which norms fold into them agree.
    fn kernel_config(&self, x: &Tensor) -> TwellConfig {
        let paths = self.config.paths();
        let (StagedRows::Auto, Some(density)) = (paths.staged_rows, self.last_density()) else {
            return self.config;
        };
        let d = self.hidden();
        let m = x.elem_count() / d.max(1);
        let staged_rows = crate::staged_rows_for(m, d, self.ffn(), self.config.tile(), density);
        self.config.with_paths(KernelPaths {
            staged_rows,
            ..paths
        })
    }

    /// The folded launch of [`Self::add_norm_fold`] with its `config`, in `x`'s shape.
    fn folded_add_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        config: TwellConfig,
        post: (&Tensor, f64),
        pre: Option<(&Tensor, f64)>,
    ) -> Result<(Tensor, Tensor)> {
        let d = self.hidden();
        let rows = |t: &Tensor| fused_ops::checks::reshaped(t, &[t.elem_count() / d, d]);
        let (sum, normed) = crate::twell_mlp_add_norm(
            &rows(x)?,
            &self.gate,
            &self.up_down()?,
            config,
            (&rows(residual)?, post.0, post.1),
            pre,
        )?;
        Ok((
            fused_ops::checks::reshaped(&sum, x.dims())?,
            fused_ops::checks::reshaped(&normed, x.dims())?,
        ))
    }

    /// The forward pass; the dense path computes the L1 term only when asked (the
    /// sparse path gets it for free).
    fn run(&self, x: &Tensor, want_l1: bool) -> Result<(Tensor, Option<Tensor>)> {
        let measure = self.measure_now(x.device(), rows(x));
        let (side, timer) = self.pick(x, Entry::Mlp, want_l1, measure)?;
        let measure = measure || self.measures_free(x.device(), side);
        self.timed(x.device(), timer, || self.run_on(side, x, want_l1, measure))
    }

    /// The forward pass on `side`, where the caller has asked [`Self::measure_now`].
    fn run_on(
        &self,
        side: Side,
        x: &Tensor,
        want_l1: bool,
        measure: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if let Some(kept) = &self.kept_inputs {
            let d = x.dims().last().copied().unwrap_or(0).max(1);
            let rows = x.detach().reshape((x.elem_count() / d, d))?;
            kept.lock().expect("kept inputs lock").push(rows);
        }
        if let (Some(q), Some(_)) = (&self.quantized, self.quantized_side(x, want_l1)) {
            return Ok((self.run_quantized(q, x)?, None));
        }
        if self.f32_released {
            return err(TwellError::Invalid(
                "this MLP keeps quantized rows only (release_f32_weights): CPU inference \
                 without an L1 term is all it runs"
                    .into(),
            ));
        }
        let dims = x.dims().to_vec();
        let d = *dims.last().unwrap_or(&0);
        if d != self.hidden() {
            return err(TwellError::ShapeMismatch {
                what: "SparseMlp::forward",
                detail: format!("input has {d} features, the MLP expects {}", self.hidden()),
            });
        }
        let lead = &dims[..dims.len() - 1];
        let rows = x.elem_count() / d.max(1);
        let x2 = fused_ops::checks::reshaped(x, &[rows, d])?;
        let sparse = side == Side::Sparse;
        let config = self.kernel_config(&x2);
        if sparse && want_l1 && self.l1_term != L1Term::Plain {
            return err(TwellError::Invalid(format!(
                "the {:?} sparsity term is computed on the dense path only: train with the \
                 dense FFN (--ffn dense)",
                self.l1_term
            )));
        }
        if sparse {
            let res = match self.screen_for(x2.dim(0)?)? {
                Some(screen) => {
                    twell_mlp_screened(&x2, &self.gate, &self.up_down()?, config, screen)?
                }
                None => {
                    let last = self.last_density();
                    twell_mlp_with_backward_path(
                        &x2,
                        &self.gate,
                        &self.up_down()?,
                        config,
                        self.backward_path
                            .unwrap_or_else(|| BackwardPath::for_density(last)),
                    )?
                }
            };
            return self.keep_op_output(res, LastForward::Sparse, measure, lead, want_l1);
        }
        if side == Side::Products {
            let res = crate::twell_mlp_products(&x2, &self.gate, &self.up_down()?, config)?;
            return self.keep_op_output(res, LastForward::Products, measure, lead, want_l1);
        }
        let add_bias = |t: Tensor, pick: fn(&MlpBias) -> &Tensor| match &self.bias {
            Some(b) => t.broadcast_add(pick(b)),
            None => Ok(t),
        };
        let gate = add_bias(x2.matmul(&self.gate.t()?)?, |b| &b.gate)?;
        // Views of a fused matrix are copied out (candle's matmul takes no row stride);
        // separate weights are contiguous already and not copied.
        let (up, down) = (self.up.contiguous()?, self.down.contiguous()?);
        let up = add_bias(x2.matmul(&up.t()?)?, |b| &b.up)?;
        let h = (self.activation.apply(&gate)? * up)?;
        let out = add_bias(h.matmul(&down.t()?)?, |b| &b.down)?;
        let l1 = match (want_l1, self.l1_term) {
            (false, _) => None,
            (true, L1Term::Plain) => Some(h.abs()?.sum(D::Minus1)?),
            (true, L1Term::GateL0) => {
                // The norms in f32 (two small passes); the count over [tokens, d_ff] is
                // one op (`ops::gate_l0`).
                let norm =
                    |t: &Tensor| (t.to_dtype(DType::F32)?.sqr()?.sum(D::Minus1)? + 1e-12)?.sqrt();
                let (x_norm, w_norm) = (norm(&x2)?, norm(&self.gate)?);
                let count =
                    crate::gate_l0(&gate, &x_norm, &w_norm, (d as f64).sqrt(), GATE_L0_EPS)?;
                Some(count.to_dtype(h.dtype())?)
            }
        };
        if measure {
            let density = count_nonzero(&h.detach())? as f64 / h.elem_count().max(1) as f64;
            self.set_density(density, rows);
            if self.record_stats {
                *self.last.lock().expect("stats lock") = Some(LastForward::Dense(h.detach()));
            }
        }
        let mut out_dims = lead.to_vec();
        out_dims.push(d);
        let l1 = match l1 {
            Some(l1) => Some(fused_ops::checks::reshaped(&l1, lead)?),
            None => None,
        };
        Ok((fused_ops::checks::reshaped(&out, &out_dims)?, l1))
    }

    /// What a forward through one of the MLP ops leaves behind: the measured density
    /// (host ops know it for free; a device op's counts are read back, a sync, only
    /// when measuring), the statistics as `as_last` files them, and the output and
    /// L1 term as views in `x`'s leading shape (neither costs a copy kernel).
    fn keep_op_output(
        &self,
        res: crate::MlpOutput,
        as_last: fn(crate::MlpOutput) -> LastForward,
        measure: bool,
        lead: &[usize],
        want_l1: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if res.pattern.is_some() || measure {
            self.set_density(res.density()?, lead.iter().product());
        }
        if self.record_stats {
            // Detached: a result that kept its graph would keep the whole forward pass
            // (every activation saved for the backward) alive until the next recorded
            // forward.
            *self.last.lock().expect("stats lock") = Some(as_last(res.detach()));
        }
        let out = res.out_with_lead(lead)?;
        let l1 = if want_l1 {
            Some(fused_ops::checks::reshaped(&res.l1, lead)?)
        } else {
            None
        };
        Ok((out, l1))
    }

    /// Statistics of the last forward (needs [`SparseMlp::with_stats`]).
    pub fn last_stats(&self) -> Result<Option<MlpStats>> {
        let last = self.last.lock().expect("stats lock");
        Ok(match last.as_ref() {
            None => None,
            Some(LastForward::Sparse(res)) => Some(MlpStats::from_output(res, true)?),
            Some(LastForward::Products(res)) => Some(MlpStats::from_output(res, false)?),
            Some(LastForward::Dense(h)) => Some(MlpStats::from_dense(h)?),
            Some(LastForward::Counted {
                rows,
                nonzeros,
                sparse,
                fired,
            }) => {
                let (rows, nonzeros, sparse) = (*rows, *nonzeros, *sparse);
                let ffn = self.ffn();
                Some(MlpStats {
                    tokens: rows,
                    ffn,
                    mean_l0: nonzeros as f64 / rows.max(1) as f64,
                    density: nonzeros as f64 / (rows * ffn).max(1) as f64,
                    overflow_tiles: 0,
                    overflow_rows: 0,
                    fired: fired.clone(),
                    sparse,
                })
            }
        })
    }
}

/// The nonzeros of one forward's activations, where they already are: a decode loop on a
/// GPU sums these and reads the total back once, where reading every layer's count after
/// every token would stall each step on the host.
#[derive(Debug, Clone)]
pub enum Nonzeros {
    /// Counted on the host (CPU ops keep their pattern there).
    Host(u64),
    /// A u32 tensor on the device whose elements sum to the count.
    Device(Tensor),
}

impl Nonzeros {
    /// The count, reading a device tensor back (one synchronisation).
    pub fn read(&self) -> Result<u64> {
        match self {
            Self::Host(n) => Ok(*n),
            Self::Device(t) => Ok(t.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()? as u64),
        }
    }

    /// The total of many counts with one read-back per device (the device tensors are
    /// flattened and joined first).
    pub fn sum(counts: &[Nonzeros]) -> Result<u64> {
        let mut total = 0u64;
        let mut on_device = Vec::new();
        for c in counts {
            match c {
                Self::Host(n) => total += n,
                Self::Device(t) => on_device.push(t.flatten_all()?),
            }
        }
        // Joined in bounded groups, so one read-back stays one read-back without a cat
        // of thousands of pieces in a single call.
        for group in on_device.chunks(1024) {
            total += Self::Device(Tensor::cat(group, 0)?).read()?;
        }
        Ok(total)
    }
}

impl SparseMlp {
    /// The last forward's nonzeros and the number of activations they were counted over
    /// (`tokens · d_ff`), with no read-back (needs [`SparseMlp::with_stats`]).
    pub fn last_nonzeros(&self) -> Result<Option<(Nonzeros, usize)>> {
        let last = self.last.lock().expect("stats lock");
        let entries = |rows: usize, ffn: usize| rows * ffn;
        Ok(match last.as_ref() {
            None => None,
            Some(LastForward::Sparse(res)) | Some(LastForward::Products(res)) => {
                let n = entries(res.out.dim(0)?, res.ffn);
                match (&res.pattern, &res.counts) {
                    (None, Some(counts)) => Some((Nonzeros::Device(counts.clone()), n)),
                    _ => Some((Nonzeros::Host(res.nnz()? as u64), n)),
                }
            }
            Some(LastForward::Counted { rows, nonzeros, .. }) => {
                Some((Nonzeros::Host(*nonzeros), rows * self.ffn()))
            }
            Some(LastForward::Dense(h)) => {
                let (rows, ffn) = h.dims2()?;
                let mask = h.ne(0.0)?.to_dtype(DType::U32)?;
                let count = if h.device().is_cpu() {
                    Nonzeros::Host(mask.sum_all()?.to_scalar::<u32>()? as u64)
                } else {
                    Nonzeros::Device(mask)
                };
                Some((count, entries(rows, ffn)))
            }
        })
    }
}

impl Module for SparseMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Contiguous on both paths: the sparse op's output rows lead its result.
        Ok(self.run(x, false)?.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_nonzero_counts_across_row_blocks() -> Result<()> {
        // 5,000 rows cross the 4,096-row block; row r has r % 8 nonzeros, some negative.
        let (m, f) = (5000usize, 8usize);
        let data: Vec<f32> = (0..m * f)
            .map(|i| {
                let (r, c) = (i / f, i % f);
                if c < r % 8 {
                    if c % 2 == 0 {
                        1.5
                    } else {
                        -0.25
                    }
                } else {
                    0.0
                }
            })
            .collect();
        let want: u64 = (0..m).map(|r| (r % 8) as u64).sum();
        let h = Tensor::from_vec(data, (m, f), &candle_core::Device::Cpu)?;
        assert_eq!(super::count_nonzero(&h)?, want);
        assert_eq!(super::count_nonzero(&h.to_dtype(DType::BF16)?)?, want);
        assert_eq!(super::count_nonzero(&h.narrow(0, 0, 0)?)?, 0);
        Ok(())
    }
}

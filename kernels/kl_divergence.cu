// kl_divergence: per-row KL(p ‖ q) of a teacher's and a student's logits [N, V], p and q
// their softmaxes, and its backward, for distillation.
//
// As candle ops (two log-softmaxes, exp, subtract, multiply, sum) the loss and its
// backward make some twenty-five f32 passes over [tokens, vocab] tensors (0.8 GB each at
// 4,096 × 49,152) and keep several of them for the backward. Here the forward reads
// both rows twice (online max and sum, then the weighted sum) and writes three floats
// per row: the KL and both log-sum-exps; the backward reads both rows once more and
// writes g · (q − p).
//
// The student is bf16; the teacher is bf16 or f32 (a teacher's logits kept in f32 are
// read as they are, so the fused loss sees the same targets as the f32 reference).
#include "twell_common.cuh"

#define KL_THREADS 256

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

template <typename Teacher>
__device__ __forceinline__ void kl_fwd(const __nv_bfloat16* __restrict__ student,  // [N, V]
                                       const Teacher* __restrict__ teacher,         // [N, V]
                                       float* __restrict__ out,  // [3, N]: KL, student lse, teacher lse
                                       int N, int V) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const __nv_bfloat16* s = student + row * V;
    const Teacher* t = teacher + row * V;
    float ms = -INFINITY, ls = 0.f, mt = -INFINITY, lt = 0.f;
    for (int j = threadIdx.x; j < V; j += KL_THREADS) {
        online_max_sum(ms, ls, __bfloat162float(s[j]));
        online_max_sum(mt, lt, to_float(t[j]));
    }
    block_max_sum<KL_THREADS>(ms, ls);
    block_max_sum<KL_THREADS>(mt, lt);
    const float lse_s = ms + __logf(ls), lse_t = mt + __logf(lt);
    // Σ_j p_j (log p_j − log q_j); a p_j that underflows to 0 adds 0.
    float acc = 0.f;
    for (int j = threadIdx.x; j < V; j += KL_THREADS) {
        const float log_p = to_float(t[j]) - lse_t;
        const float log_q = __bfloat162float(s[j]) - lse_s;
        acc += __expf(log_p) * (log_p - log_q);
    }
    acc = warp_sum(acc);
    __shared__ float partial[KL_THREADS / 32];
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int w = 0; w < KL_THREADS / 32; ++w) sum += partial[w];
        // KL ≥ 0; near a student that matches its teacher the f32 sum can round below.
        out[row] = fmaxf(sum, 0.f);
        out[N + row] = lse_s;
        out[2LL * N + row] = lse_t;
    }
}

template <typename Teacher>
__device__ __forceinline__ void kl_bwd(const __nv_bfloat16* __restrict__ student,  // [N, V]
                                       const Teacher* __restrict__ teacher,         // [N, V]
                                       const float* __restrict__ aux,  // [3, N]: student lse, teacher lse, g
                                       __nv_bfloat16* __restrict__ out,  // [N, V]: g · (q − p)
                                       int N, int V) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const __nv_bfloat16* s = student + row * V;
    const Teacher* t = teacher + row * V;
    __nv_bfloat16* o = out + row * V;
    const float lse_s = aux[row], lse_t = aux[N + row], g = aux[2LL * N + row];
    for (int j = threadIdx.x; j < V; j += KL_THREADS) {
        const float q = __expf(__bfloat162float(s[j]) - lse_s);
        const float p = __expf(to_float(t[j]) - lse_t);
        o[j] = __float2bfloat16(g * (q - p));
    }
}

// Entry points: the suffix names the student's and the teacher's dtypes.
extern "C" __global__ void __launch_bounds__(KL_THREADS)
    kl_divergence_fwd_bf16(const __nv_bfloat16* student, const __nv_bfloat16* teacher, float* out, int N, int V) {
    kl_fwd(student, teacher, out, N, V);
}
extern "C" __global__ void __launch_bounds__(KL_THREADS)
    kl_divergence_fwd_bf16_f32(const __nv_bfloat16* student, const float* teacher, float* out, int N, int V) {
    kl_fwd(student, teacher, out, N, V);
}
extern "C" __global__ void __launch_bounds__(KL_THREADS)
    kl_divergence_bwd_bf16(const __nv_bfloat16* student, const __nv_bfloat16* teacher, const float* aux,
                           __nv_bfloat16* out, int N, int V) {
    kl_bwd(student, teacher, aux, out, N, V);
}
extern "C" __global__ void __launch_bounds__(KL_THREADS)
    kl_divergence_bwd_bf16_f32(const __nv_bfloat16* student, const float* teacher, const float* aux,
                               __nv_bfloat16* out, int N, int V) {
    kl_bwd(student, teacher, aux, out, N, V);
}

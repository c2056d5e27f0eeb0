// kl_divergence: per-row KL(p ‖ q) of a teacher's and a student's logits [N, V], p and q
// their softmaxes, and its backward, for distillation.
//
// As candle ops (two log-softmaxes, exp, subtract, multiply, sum) the loss and its
// backward make some twenty-five f32 passes over [tokens, vocab] tensors (0.8 GB each at
// 4,096 × 49,152) and keep several of them for the backward. Here the forward reads
// both rows once and writes three floats per row: the KL and both log-sum-exps; the
// backward reads both rows once more and writes g · (q − p).
//
// One forward pass: with t the teacher's and s the student's logits,
//   KL = Σ_j p_j (t_j − s_j) − lse_t + lse_s      (as Σ_j p_j = 1),
// and Σ_j p_j (t_j − s_j) = Σ_j e^(t_j − m) (t_j − s_j) / Σ_j e^(t_j − m) is an online sum
// like the softmax's own: rescaled whenever the running maximum m moves.
//
// The student is bf16; the teacher is bf16 or f32 (a teacher's logits kept in f32 are
// read as they are, so the fused loss sees the same targets as the f32 reference). Rows
// are read 8 elements per access where V is a multiple of 8 and both inputs are
// 32-byte aligned, one element per access otherwise.
#include "common.cuh"

#define KL_THREADS 256

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ void load8_any(const __nv_bfloat16* p, float* out) { load8(p, out); }
__device__ __forceinline__ void load8_any(const float* p, float* out) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// Whether a row of V elements can be read 8 at a time from both inputs (every row then
// starts 16-byte aligned too).
template <typename Teacher>
__device__ __forceinline__ bool vector_rows(const __nv_bfloat16* student, const Teacher* teacher, int V) {
    return V % 8 == 0 && (reinterpret_cast<uintptr_t>(student) | reinterpret_cast<uintptr_t>(teacher)) % 32 == 0;
}

// One thread's running sums over its share of a row: the student's online max and sum
// (ms, ls), the teacher's (mt, lt), and a = Σ e^(t − mt) (t − s).
// (A plain struct, so that it can sit in shared memory: start from kl_empty().)
struct KlState {
    float ms, ls, mt, lt, a;

    __device__ __forceinline__ void add(float t, float s) {
        online_max_sum(ms, ls, s);
        if (t > mt) {
            // From mt = -inf: lt and a are 0, so the rescale is 0 · 0.
            const float c = __expf(mt - t);
            lt = lt * c + 1.f;
            a = a * c + (t - s);
            mt = t;
        } else {
            const float e = __expf(t - mt);
            lt += e;
            // A p that underflows to 0 adds 0 (never 0 · inf).
            if (e > 0.f) a += e * (t - s);
        }
    }

    __device__ __forceinline__ void merge(const KlState& o) {
        merge_max_sum(ms, ls, o.ms, o.ls);
        if (o.mt == -INFINITY) return;
        if (mt == -INFINITY) {
            mt = o.mt, lt = o.lt, a = o.a;
            return;
        }
        const float mx = fmaxf(mt, o.mt);
        const float c = __expf(mt - mx), co = __expf(o.mt - mx);
        lt = lt * c + o.lt * co;
        a = a * c + o.a * co;
        mt = mx;
    }

    __device__ __forceinline__ KlState shfl_xor(int o) const {
        KlState r;  // every field set below
        r.ms = __shfl_xor_sync(FULL_MASK, ms, o);
        r.ls = __shfl_xor_sync(FULL_MASK, ls, o);
        r.mt = __shfl_xor_sync(FULL_MASK, mt, o);
        r.lt = __shfl_xor_sync(FULL_MASK, lt, o);
        r.a = __shfl_xor_sync(FULL_MASK, a, o);
        return r;
    }
};

__device__ __forceinline__ KlState kl_empty() { return KlState{-INFINITY, 0.f, -INFINITY, 0.f, 0.f}; }

template <typename Teacher>
__device__ __forceinline__ void kl_fwd(const __nv_bfloat16* __restrict__ student,  // [N, V]
                                       const Teacher* __restrict__ teacher,         // [N, V]
                                       float* __restrict__ out,  // [3, N]: KL, student lse, teacher lse
                                       int N, int V) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const __nv_bfloat16* s = student + row * V;
    const Teacher* t = teacher + row * V;
    KlState st = kl_empty();
    if (vector_rows(student, teacher, V)) {
        for (int j = 8 * threadIdx.x; j < V; j += 8 * KL_THREADS) {
            float sv[8], tv[8];
            load8(s + j, sv);
            load8_any(t + j, tv);
#pragma unroll
            for (int k = 0; k < 8; ++k) st.add(tv[k], sv[k]);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += KL_THREADS) st.add(to_float(t[j]), to_float(s[j]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) st.merge(st.shfl_xor(o));
    __shared__ KlState partial[KL_THREADS / 32];
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = st;
    __syncthreads();
    if (threadIdx.x == 0) {
        KlState all = kl_empty();
        for (int w = 0; w < KL_THREADS / 32; ++w) all.merge(partial[w]);
        const float lse_s = all.ms + __logf(all.ls), lse_t = all.mt + __logf(all.lt);
        // KL ≥ 0; near a student that matches its teacher the f32 sums can round below.
        out[row] = fmaxf(all.a / all.lt - lse_t + lse_s, 0.f);
        out[N + row] = lse_s;
        out[2LL * N + row] = lse_t;
    }
}

// d KL / d s_j = g · (q_j − p_j): the student's and the teacher's softmax at one logit.
__device__ __forceinline__ float kl_grad(float s, float t, float lse_s, float lse_t, float g) {
    return g * (__expf(s - lse_s) - __expf(t - lse_t));
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
    if (vector_rows(student, teacher, V) && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
        for (int j = 8 * threadIdx.x; j < V; j += 8 * KL_THREADS) {
            float sv[8], tv[8];
            load8(s + j, sv);
            load8_any(t + j, tv);
#pragma unroll
            for (int k = 0; k < 8; ++k) sv[k] = kl_grad(sv[k], tv[k], lse_s, lse_t, g);
            store8(o + j, sv);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += KL_THREADS)
            o[j] = __float2bfloat16(kl_grad(to_float(s[j]), to_float(t[j]), lse_s, lse_t, g));
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

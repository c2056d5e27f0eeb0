// adamw: the AdamW update of one f32 parameter in two in-place passes.
//
// As candle ops an update is some seventeen elementwise passes over the parameter
// (moments, bias corrections, square root, division, decay, subtraction, the copy into
// the variable); on a 1.5 B-parameter model that is most of the optimizer's 130 ms.
// Here:
//   adamw_moment_f32: m ← β·m + (1 − β)·(s·g), or with `square` the same on (s·g)²
//                     (s the clipping scale), in place on m or v;
//   adamw_update_f32: p ← p·(1 − lr·wd) − lr·(m / c1) / (√(v / c2) + eps), in place.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "common.cuh"

// One moment's update with the (scaled, possibly squared) gradient g.
__device__ __forceinline__ float adam_moment(float beta, float m, float g) {
    return fmaf(beta, m, (1.f - beta) * g);
}

// The parameter after the step, from its moments.
__device__ __forceinline__ float adam_param(float p, float m, float v, float lr, float decay,
                                            float inv_c1, float inv_c2, float eps) {
    return p * decay - lr * ((m * inv_c1) / (sqrtf(v * inv_c2) + eps));
}

extern "C" __global__ void adamw_moment_f32(float* __restrict__ moment,
                                            const float* __restrict__ grad, long long n,
                                            float beta, float scale, int square) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float g = grad[i] * scale;
        if (square) g *= g;
        moment[i] = adam_moment(beta, moment[i], g);
    }
}

extern "C" __global__ void adamw_update_f32(float* __restrict__ param, const float* __restrict__ m,
                                            const float* __restrict__ v, long long n, float lr,
                                            float decay, float inv_c1, float inv_c2, float eps) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        param[i] = adam_param(param[i], m[i], v[i], lr, decay, inv_c1, inv_c2, eps);
    }
}

// Mixed precision: the model's variables are bf16 and the optimizer keeps each one's
// f32 master with its moments in one state tensor [3, n] (master, m, v). One pass
// updates all three (what adamw_moment twice and adamw_update do to an f32 variable),
// then bf16_from_master writes the rounded master into the bf16 variable.
template <typename G>
__device__ __forceinline__ void adamw_mixed(float* __restrict__ state, const G* __restrict__ grad,
                                            long long n, float beta1, float beta2, float scale,
                                            float lr, float decay, float inv_c1, float inv_c2,
                                            float eps) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float g = static_cast<float>(grad[i]) * scale;
        const float m = adam_moment(beta1, state[n + i], g);
        const float v = adam_moment(beta2, state[2 * n + i], g * g);
        state[n + i] = m;
        state[2 * n + i] = v;
        state[i] = adam_param(state[i], m, v, lr, decay, inv_c1, inv_c2, eps);
    }
}

#define ADAMW_MIXED(NAME, G)                                                                     \
    extern "C" __global__ void NAME(float* __restrict__ state, const G* __restrict__ grad,       \
                                    long long n, float beta1, float beta2, float scale, float lr, \
                                    float decay, float inv_c1, float inv_c2, float eps) {        \
        adamw_mixed<G>(state, grad, n, beta1, beta2, scale, lr, decay, inv_c1, inv_c2, eps);     \
    }
ADAMW_MIXED(adamw_mixed_bf16, __nv_bfloat16)
ADAMW_MIXED(adamw_mixed_f32, float)

extern "C" __global__ void bf16_from_master(__nv_bfloat16* __restrict__ param,
                                            const float* __restrict__ master, long long n) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        param[i] = __float2bfloat16(master[i]);
    }
}

// The sum of squares of a gradient (bf16 or f32), in f32, for the global gradient norm
// of clipping: one read of the gradient, where candle's ops would cast it to f32, square
// it and reduce it in three passes. Each block adds its partial sum to `out` (zeroed).
template <typename G>
__device__ __forceinline__ void sum_squares(const G* __restrict__ x, long long n, float* __restrict__ out) {
    float acc = 0.f;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float v = static_cast<float>(x[i]);
        acc = fmaf(v, v, acc);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ float partial[32];
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < (blockDim.x + 31) / 32; ++w) total += partial[w];
        red_add(out, total);
    }
}

extern "C" __global__ void sum_squares_bf16(const __nv_bfloat16* __restrict__ x, long long n,
                                            float* __restrict__ out) {
    sum_squares<__nv_bfloat16>(x, n, out);
}

extern "C" __global__ void sum_squares_f32(const float* __restrict__ x, long long n,
                                           float* __restrict__ out) {
    sum_squares<float>(x, n, out);
}

// One row's residual add and RMS norm by one block of NORM_THREADS threads.
//
// Thread t holds the row's 16-byte vectors t, t + NORM_THREADS, ... (NV of them, zero past
// the row), adds them in candle's order of operations (the sum rounded to bf16, as
// candle's add would store it, then s · rsqrt(mean(s²) + eps) · alpha), and the block
// reduces Σ s² in one fixed order. `add_rms_norm.cu` and the one-token MLP's prologue and
// epilogue (`twell_mlp_decode.cu`) all go through these helpers, so they give the same
// bits and a model may fold a norm into either.
#pragma once
#include "common.cuh"

#define NORM_THREADS 256

// The thread's vectors of a bf16 row of `vecs` 16-byte vectors, as they are in memory
// (zero past the row): 4 registers a vector until they are added.
template <int NV>
__device__ __forceinline__ void norm_row_load(const __nv_bfloat16* __restrict__ row, int vecs, uint4 (&r)[NV]) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int v = threadIdx.x + i * NORM_THREADS;
        r[i] = v < vecs ? *reinterpret_cast<const uint4*>(row + v * VEC) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// s = bf16(x + y) over the thread's vectors; returns the thread's share of Σ s².
template <int NV>
__device__ __forceinline__ float norm_row_add(const uint4 (&x)[NV], const uint4 (&y)[NV], float (&s)[NV][VEC]) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&x[i]);
        const __nv_bfloat162* yh = reinterpret_cast<const __nv_bfloat162*>(&y[i]);
#pragma unroll
        for (int q = 0; q < VEC / 2; ++q) {
            const float2 a = __bfloat1622float2(xh[q]);
            const float2 b = __bfloat1622float2(yh[q]);
            s[i][2 * q] = round_bf16(a.x + b.x);
            ss = fmaf(s[i][2 * q], s[i][2 * q], ss);
            s[i][2 * q + 1] = round_bf16(a.y + b.y);
            ss = fmaf(s[i][2 * q + 1], s[i][2 * q + 1], ss);
        }
    }
    return ss;
}

// rsqrt(Σ s² / d + eps) from every thread's share, in every thread. Ends with the
// block's threads past a barrier, so `partial` is free again once they have read it.
__device__ __forceinline__ float norm_row_scale(float ss, int d, float eps) {
    __shared__ float partial[NORM_THREADS / 32];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < NORM_THREADS / 32; ++w) total += partial[w];
    __syncthreads();  // a later call writes `partial` again
    return rsqrtf(total / d + eps);
}

// Stores the thread's vectors of a float row as bf16.
template <int NV>
__device__ __forceinline__ void norm_row_store(__nv_bfloat16* row, int vecs, const float (&r)[NV][VEC]) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int v = threadIdx.x + i * NORM_THREADS;
        if (v < vecs) store8(row + v * VEC, r[i]);
    }
}

// Stores scale · s · alpha (the normalised row) as bf16.
template <int NV>
__device__ __forceinline__ void norm_row_store_scaled(__nv_bfloat16* row, int vecs, float scale,
                                                      const float (&s)[NV][VEC], const uint4 (&alpha)[NV]) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int v = threadIdx.x + i * NORM_THREADS;
        if (v < vecs) {
            const __nv_bfloat162* ah = reinterpret_cast<const __nv_bfloat162*>(&alpha[i]);
            float o[VEC];
#pragma unroll
            for (int q = 0; q < VEC / 2; ++q) {
                const float2 a = __bfloat1622float2(ah[q]);
                o[2 * q] = scale * s[i][2 * q] * a.x;
                o[2 * q + 1] = scale * s[i][2 * q + 1] * a.y;
            }
            store8(row + v * VEC, o);
        }
    }
}

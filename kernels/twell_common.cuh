// Shared helpers of the TwELL kernels: bf16 vectors, warp reductions, the layout constants.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

// Elements of d per lane-step: one 16-byte vector of 8 bf16.
#define VEC 8
// d-elements one warp covers per step of the down projection (32 lanes x 8).
#define WARP_CHUNK 256
// Columns after the d outputs of each row: column d holds the token's L1 term, the
// rest pad the row to 16 bytes so every row starts aligned.
#define L1_COLUMNS 8

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// 8 bf16 <-> 8 floats through one 16-byte access.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* out) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float2 f = __bfloat1622float2(h[k]);
        out[2 * k] = f.x;
        out[2 * k + 1] = f.y;
    }
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float* in) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(in[2 * k], in[2 * k + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
}

// x . w over d elements (d a multiple of 8, both 16-byte aligned), by one warp:
// lane l takes vectors l, l + 32, ...; the result is in every lane.
__device__ __forceinline__ float warp_dot(const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ w, int d) {
    float acc = 0.f;
    const int lane = threadIdx.x & 31;
    for (int v = lane; v * VEC < d; v += 32) {
        float a[VEC], b[VEC];
        load8(x + v * VEC, a);
        load8(w + v * VEC, b);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc = fmaf(a[k], b[k], acc);
    }
    return warp_sum(acc);
}

__device__ __forceinline__ long long global_warp() {
    return (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
}

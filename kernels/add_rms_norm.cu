// add_rms_norm: the residual add and the RMS norm after it, in one pass over the rows.
//
// A Llama block adds each sublayer's output to the residual stream and normalises the
// sum for the next sublayer: as two candle ops that is three reads and two writes of
// [M, d] and two launches (candle's norm also reads bf16 one element at a time). Here one
// block per row reads x and y once (16-byte loads), writes the sum s = x + y rounded to
// bf16 (what candle's add would store) and the normalised row
// s · rsqrt(mean(s²) + eps) · alpha, in candle's order of operations.
#include "twell_common.cuh"

#define NORM_THREADS 256
// 16-byte vectors a thread keeps in registers between the two passes (d up to 8,192).
#define NORM_MAX_VECS 4

extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rms_norm_bf16(
    const __nv_bfloat16* __restrict__ x,      // [M, d]
    const __nv_bfloat16* __restrict__ y,      // [M, d]
    const __nv_bfloat16* __restrict__ alpha,  // [d]
    __nv_bfloat16* __restrict__ out,          // [2, M, d]: the sums, then the normalised rows
    int M, int d, float eps) {
    const long long row = blockIdx.x;
    if (row >= M) return;
    const int vecs = d / VEC;
    const long long base = row * d;
    __nv_bfloat16* sum = out + base;
    __nv_bfloat16* normed = out + static_cast<long long>(M) * d + base;
    float s[NORM_MAX_VECS][VEC];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_MAX_VECS; ++i) {
        const int v = threadIdx.x + i * NORM_THREADS;
        if (v < vecs) {
            float a[VEC], b[VEC];
            load8(x + base + v * VEC, a);
            load8(y + base + v * VEC, b);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                s[i][k] = round_bf16(a[k] + b[k]);
                ss = fmaf(s[i][k], s[i][k], ss);
            }
            store8(sum + v * VEC, s[i]);
        }
    }
    __shared__ float partial[NORM_THREADS / 32];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < NORM_THREADS / 32; ++w) total += partial[w];
    const float scale = rsqrtf(total / d + eps);
#pragma unroll
    for (int i = 0; i < NORM_MAX_VECS; ++i) {
        const int v = threadIdx.x + i * NORM_THREADS;
        if (v < vecs) {
            float a[VEC], o[VEC];
            load8(alpha + v * VEC, a);
#pragma unroll
            for (int k = 0; k < VEC; ++k) o[k] = scale * s[i][k] * a[k];
            store8(normed + v * VEC, o);
        }
    }
}

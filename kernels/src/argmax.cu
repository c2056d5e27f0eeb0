// The index of each row's largest value (the first, where several tie), for greedy
// decoding: one block of 1024 threads a row, each thread a strided share of the row, then
// a warp and a block reduction. candle's argmax ran one block for the whole
// [rows, 49,152] logits: 40 µs of a decode step on an H200.
#include "common.cuh"

#define ARGMAX_THREADS 1024

// (v, i) better than (bv, bi): larger, or equal and earlier. NaN is never better.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_rows_f32(const float* __restrict__ x, uint32_t* __restrict__ out, int n) {
    const float* row = x + static_cast<long long>(blockIdx.x) * n;
    float best = -INFINITY;
    int at = n;  // past the row: loses every tie against a real index
    // Eight loads in flight a thread before any compare: a row is 48 values a thread at
    // a 49k vocabulary, and one load at a time would wait 48 round trips.
    for (int base = threadIdx.x; base < n; base += 8 * ARGMAX_THREADS) {
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int i = base + k * ARGMAX_THREADS;
            v[k] = i < n ? __ldg(row + i) : -INFINITY;
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int i = base + k * ARGMAX_THREADS;
            if (i < n && better(v[k], i, best, at)) {
                best = v[k];
                at = i;
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, best, o);
        const int i = __shfl_xor_sync(FULL_MASK, at, o);
        if (better(v, i, best, at)) {
            best = v;
            at = i;
        }
    }
    __shared__ float warp_best[ARGMAX_THREADS / 32];
    __shared__ int warp_at[ARGMAX_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_best[warp] = best;
        warp_at[warp] = at;
    }
    __syncthreads();
    if (warp != 0) return;
    best = warp_best[lane];
    at = warp_at[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, best, o);
        const int i = __shfl_xor_sync(FULL_MASK, at, o);
        if (better(v, i, best, at)) {
            best = v;
            at = i;
        }
    }
    // A row of NaN only names index 0, as a scan that never finds a larger value would.
    if (lane == 0) out[blockIdx.x] = at < n ? static_cast<uint32_t>(at) : 0u;
}

// embedding: the backward of a token embedding (the forward is a row gather).
//
// d(weight)[id, :] = Σ over the tokens t with ids[t] = id of grad[t, :]. candle's
// index_add runs it in bf16 on a few blocks (4.3 ms a step for 8,192 tokens of 2,048 on
// an H200). Here one thread per (token, 8 columns) adds into an f32 accumulator with
// atomics (tokens of the same id meet there), then the accumulator is rounded to bf16.
#include "common.cuh"

extern "C" __global__ void embedding_grad_accumulate_bf16(
    const uint32_t* __restrict__ ids,       // [tokens]
    const __nv_bfloat16* __restrict__ grad, // [tokens, d]
    float* __restrict__ acc,                // [vocab, d], zeroed
    long long tokens, int d) {
    const int vecs = d / VEC;
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= tokens * vecs) return;
    const long long t = i / vecs;
    const int c = static_cast<int>(i % vecs) * VEC;
    float g[VEC];
    load8(grad + t * d + c, g);
    float* dst = acc + static_cast<long long>(ids[t]) * d + c;
#pragma unroll
    for (int k = 0; k < VEC; ++k) red_add(dst + k, g[k]);
}

extern "C" __global__ void embedding_grad_to_bf16(const float* __restrict__ acc,
                                                  __nv_bfloat16* __restrict__ out, long long n) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        out[i] = __float2bfloat16(acc[i]);
    }
}

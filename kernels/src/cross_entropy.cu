// cross_entropy: per-row softmax cross-entropy of logits [N, V] against targets [N], and
// its backward, for the language-model loss.
//
// As candle ops (log_softmax then gather) a training step makes some fifteen f32
// passes over the largest tensor it has ([tokens, vocab], 1.6 GB at 8,192 × 49,152),
// backward included. Here the forward reads each row once (online max and sum) and
// writes two floats per row: the loss lse − x[target], and the lse for the backward;
// the backward reads the row once more and writes g · (softmax − onehot).
#include "common.cuh"

#define CE_THREADS 256

extern "C" __global__ void __launch_bounds__(CE_THREADS) cross_entropy_fwd_bf16(
    const __nv_bfloat16* __restrict__ logits,  // [N, V]
    const unsigned int* __restrict__ targets,  // [N]
    float* __restrict__ out,                   // [2, N]: losses, then lse
    int N, int V) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const __nv_bfloat16* x = logits + row * V;
    float m = -INFINITY, l = 0.f;
    for (int j = threadIdx.x; j < V; j += CE_THREADS) {
        online_max_sum(m, l, __bfloat162float(x[j]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(FULL_MASK, m, o);
        const float l2 = __shfl_xor_sync(FULL_MASK, l, o);
        merge_max_sum(m, l, m2, l2);
    }
    __shared__ float2 partial[CE_THREADS / 32];
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = make_float2(m, l);
    __syncthreads();
    if (threadIdx.x == 0) {
        float mm = -INFINITY, ll = 0.f;
        for (int w = 0; w < CE_THREADS / 32; ++w) merge_max_sum(mm, ll, partial[w].x, partial[w].y);
        const float lse = mm + __logf(ll);
        const unsigned int target = targets[row];
        // A target outside the vocabulary is caught on the host before the launch.
        out[row] = lse - __bfloat162float(x[target]);
        out[N + row] = lse;
    }
}

extern "C" __global__ void __launch_bounds__(CE_THREADS) cross_entropy_bwd_bf16(
    const __nv_bfloat16* __restrict__ logits,  // [N, V]
    const unsigned int* __restrict__ targets,  // [N]
    const float* __restrict__ lse,             // [N]
    const float* __restrict__ grad,            // [N]: d loss / d (row loss)
    __nv_bfloat16* __restrict__ out,           // [N, V]
    int N, int V) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const __nv_bfloat16* x = logits + row * V;
    __nv_bfloat16* o = out + row * V;
    const float g = grad[row], s = lse[row];
    const unsigned int target = targets[row];
    for (int j = threadIdx.x; j < V; j += CE_THREADS) {
        const float p = __expf(__bfloat162float(x[j]) - s);
        o[j] = __float2bfloat16(g * (p - (j == static_cast<int>(target) ? 1.f : 0.f)));
    }
}

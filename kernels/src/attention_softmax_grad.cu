// attention_softmax_grad: the row-wise middle of causal attention's backward.
//
// Given a row's raw scores s_j = q·k_j (bf16, from cuBLAS), dp_j = dO·v_j and
// D = rowsum(dO ⊙ O) (f32), one warp rebuilds the probabilities of the visible keys
// (j <= past + i, the causal mask) with an online max and sum, then writes
//   p_j  = exp(s_j·scale − max) / sum,
//   ds_j = p_j · (dp_j − D) · scale          (the scale of dq and dk folded in),
// and zeros past the mask. One pass over s for the statistics, one for the outputs:
// this replaces a mask add, a softmax and four f32 elementwise passes with their casts.
#include "common.cuh"

#define SOFTMAX_GRAD_THREADS 256
#define SOFTMAX_GRAD_ROWS (SOFTMAX_GRAD_THREADS / 32)

extern "C" __global__ void __launch_bounds__(SOFTMAX_GRAD_THREADS) attention_softmax_grad_bf16(
    const __nv_bfloat16* __restrict__ s,   // [rows, total]
    const __nv_bfloat16* __restrict__ dp,  // [rows, total]
    const float* __restrict__ d,           // [rows]
    __nv_bfloat16* __restrict__ out,       // [2, rows, total]: p, then ds
    long long rows, int t, int total, float scale) {
    const int lane = threadIdx.x & 31;
    const long long row = static_cast<long long>(blockIdx.x) * SOFTMAX_GRAD_ROWS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int visible = total - t + static_cast<int>(row % t) + 1;
    const long long base = row * total;
    const __nv_bfloat16* sr = s + base;
    float m = -INFINITY, l = 0.f;
    for (int j = lane; j < visible; j += 32) {
        online_max_sum(m, l, __bfloat162float(sr[j]) * scale);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(FULL_MASK, m, o);
        const float l2 = __shfl_xor_sync(FULL_MASK, l, o);
        merge_max_sum(m, l, m2, l2);
    }
    const float inv = 1.f / l, dd = d[row];
    const __nv_bfloat16* dr = dp + base;
    __nv_bfloat16* pr = out + base;
    __nv_bfloat16* gr = out + rows * total + base;
    for (int j = lane; j < total; j += 32) {
        float p = 0.f, g = 0.f;
        if (j < visible) {
            p = __expf(__bfloat162float(sr[j]) * scale - m) * inv;
            g = p * (__bfloat162float(dr[j]) - dd) * scale;
        }
        pr[j] = __float2bfloat16(p);
        gr[j] = __float2bfloat16(g);
    }
}

// D = rowsum(dO ⊙ O) of each (batch, head, query), in f32, from the attention's output
// and its gradient as token rows [b·t, heads·hd] (the layout the model's projections
// use), written in the [b, heads, t] order of the score rows above. One thread per
// (batch, head, query) reads its two head slices with 16-byte loads: one pass, where
// candle's ops cast both to f32, multiply and sum over [b, heads, t, hd].
extern "C" __global__ void attention_row_dot_bf16(
    const __nv_bfloat16* __restrict__ grad,  // [b·t, heads·hd]
    const __nv_bfloat16* __restrict__ out,   // [b·t, heads·hd]
    float* __restrict__ d,                   // [b, heads, t]
    long long rows, int t, int heads, int hd) {
    const long long r = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const long long query = r % t;
    const long long head = (r / t) % heads;
    const long long batch = r / (static_cast<long long>(t) * heads);
    const long long at = ((batch * t + query) * heads + head) * hd;
    float acc = 0.f;
    for (int k = 0; k < hd; k += VEC) {
        float a[VEC], b[VEC];
        load8(grad + at + k, a);
        load8(out + at + k, b);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc = fmaf(a[e], b[e], acc);
    }
    d[r] = acc;
}

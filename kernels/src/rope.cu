// rope: rotary position embedding of [b, t, heads, hd] rows (queries or keys), or of
// fused q | k | v projection rows, whose first `rot_heads` heads turn and the rest (the
// values) are copied.
//
// Each (position, head) row turns by its position's angles, rotate-half convention (as
// HF Llama): for i < hd/2,
//   out[i]        = x[i] · cos[i] − x[i + hd/2] · sin[i]
//   out[i + hd/2] = x[i] · sin[i] + x[i + hd/2] · cos[i].
// candle's rope_thd runs one element per thread with 2-byte loads and bf16 arithmetic;
// here a thread turns 8 pairs with 16-byte loads, in f32, rounding once.
//
// A call turns a range of heads of each token row, `count` heads from `first`, into
// rows of their own: all heads for plain RoPE; for fused q | k | v rows, the queries in
// one call and the keys | values in another, so each is a tensor of its own (a KV cache
// that keeps the keys and values then holds nothing else, and copies nothing).
//
// `rope_in_place_bf16` turns the first `rot_heads` heads of each row where they lie and
// leaves the rest alone: the keys of `k | v` rows that a product wrote as the KV cache
// keeps them, so the values are neither read nor copied.
#include "common.cuh"

#define ROPE_THREADS 256

// Turns the 8 pairs (src[c + e], src[half + c + e]) of one row by position `pos`'s
// angles into dst (which may be src: every load comes before the first store).
__device__ __forceinline__ void turn_eight_pairs(const __nv_bfloat16* src,
                                                 __nv_bfloat16* dst,
                                                 const __nv_bfloat16* __restrict__ cs,
                                                 int pos, int hd, int c) {
    const int half = hd / 2;
    float x1[VEC], x2[VEC], co[VEC], sn[VEC], o1[VEC], o2[VEC];
    load8(src + c, x1);
    load8(src + half + c, x2);
    const __nv_bfloat16* angles = cs + static_cast<long long>(pos) * hd;
    load8(angles + c, co);
    load8(angles + half + c, sn);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        rope_turn(x1[e], x2[e], co[e], sn[e], o1[e], o2[e]);
    }
    store8(dst + c, o1);
    store8(dst + half + c, o2);
}

extern "C" __global__ void __launch_bounds__(ROPE_THREADS) rope_bf16(
    const __nv_bfloat16* __restrict__ x,   // [tokens, heads, hd]
    const __nv_bfloat16* __restrict__ cs,  // [t, hd]: each position's cos, then its sin
    __nv_bfloat16* __restrict__ out,       // [tokens, count, hd]
    long long tokens, int t, int heads, int hd, int rot_heads, int first, int count) {
    const int half = hd / 2, groups = half / VEC;  // 8-pair groups per row
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= tokens * count * groups) return;
    const long long row = i / groups;  // (token, head of the range) output row
    const int c = static_cast<int>(i % groups) * VEC;
    const long long token = row / count;
    const int head = first + static_cast<int>(row % count);
    const int pos = static_cast<int>(token % t);
    const __nv_bfloat16* src = x + (token * heads + head) * hd;
    __nv_bfloat16* dst = out + row * hd;
    if (head >= rot_heads) {  // a value head: copied
        float x1[VEC], x2[VEC];
        load8(src + c, x1);
        load8(src + half + c, x2);
        store8(dst + c, x1);
        store8(dst + half + c, x2);
        return;
    }
    turn_eight_pairs(src, dst, cs, pos, hd, c);
}

extern "C" __global__ void __launch_bounds__(ROPE_THREADS) rope_in_place_bf16(
    __nv_bfloat16* x,                      // [tokens, heads, hd], turned in place
    const __nv_bfloat16* __restrict__ cs,  // [t, hd]: each position's cos, then its sin
    long long tokens, int t, int heads, int hd, int rot_heads) {
    const int groups = hd / 2 / VEC;
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= tokens * rot_heads * groups) return;
    const long long row = i / groups;  // (token, turned head)
    const int c = static_cast<int>(i % groups) * VEC;
    const long long token = row / rot_heads;
    const int head = static_cast<int>(row % rot_heads);
    const int pos = static_cast<int>(token % t);
    __nv_bfloat16* at = x + (token * heads + head) * hd;
    turn_eight_pairs(at, at, cs, pos, hd, c);
}

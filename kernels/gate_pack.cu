// gate_pack: relu(gate) packed into TwELL. The gate GEMM itself runs on cuBLAS; this
// kernel reads its bf16 output once and keeps the values > 0.
//
// One warp per (row, tile). Lanes read 32 consecutive columns at a time, a ballot
// ranks the positive ones, and each writes its slot. A tile with more nonzeros than
// slots gets its true count (> capacity); consumers then read that tile from the dense
// gate instead, so nothing is lost.
#include "twell_common.cuh"

extern "C" __global__ void twell_gate_pack_bf16(
    const __nv_bfloat16* __restrict__ gate,  // [M, f]
    uint32_t* __restrict__ counts,           // [M, n_tiles]
    uint8_t* __restrict__ indices,           // [M, n_tiles, cap]
    __nv_bfloat16* __restrict__ values,      // [M, n_tiles, cap]
    int M, int f, int tile, int cap, int n_tiles) {
    const long long w = global_warp();
    const int lane = threadIdx.x & 31;
    if (w >= static_cast<long long>(M) * n_tiles) return;
    const long long row = w / n_tiles;
    const int t = static_cast<int>(w % n_tiles);
    const int c0 = t * tile;
    const int width = min(tile, f - c0);
    const __nv_bfloat16* src = gate + row * f + c0;
    const long long slot0 = w * cap;
    int count = 0;
    for (int k = 0; k < width; k += 32) {
        const int c = k + lane;
        __nv_bfloat16 v = c < width ? src[c] : __float2bfloat16(0.f);
        const bool active = __bfloat162float(v) > 0.f;
        const uint32_t mask = __ballot_sync(FULL_MASK, active);
        const int pos = count + __popc(mask & ((1u << lane) - 1u));
        if (active && pos < cap) {
            indices[slot0 + pos] = static_cast<uint8_t>(c);
            values[slot0 + pos] = v;
        }
        count += __popc(mask);
    }
    if (lane == 0) counts[w] = static_cast<uint32_t>(count);
}

// The same with 16-byte loads, for d_ff % 8 == 0 (then every row and tile start is
// 16-byte aligned): each lane reads 8 columns at once, ranks its positives with a
// warp prefix sum, and writes its slots. One pass over the gate at full bandwidth.
extern "C" __global__ void twell_gate_pack_vec_bf16(
    const __nv_bfloat16* __restrict__ gate,  // [M, f]
    uint32_t* __restrict__ counts,           // [M, n_tiles]
    uint8_t* __restrict__ indices,           // [M, n_tiles, cap]
    __nv_bfloat16* __restrict__ values,      // [M, n_tiles, cap]
    int M, int f, int tile, int cap, int n_tiles) {
    const long long w = global_warp();
    const int lane = threadIdx.x & 31;
    if (w >= static_cast<long long>(M) * n_tiles) return;
    const long long row = w / n_tiles;
    const int t = static_cast<int>(w % n_tiles);
    const int c0 = t * tile;
    const int width = min(tile, f - c0);
    const __nv_bfloat16* src = gate + row * f + c0;
    const long long slot0 = w * cap;
    int count = 0;
    for (int k = 0; k < width; k += 32 * VEC) {
        const int c = k + lane * VEC;
        uint4 raw = make_uint4(0u, 0u, 0u, 0u);
        if (c < width) raw = *reinterpret_cast<const uint4*>(src + c);
        const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
        uint32_t bits = 0;
#pragma unroll
        for (int q = 0; q < VEC; ++q) bits |= (__bfloat162float(v[q]) > 0.f ? 1u : 0u) << q;
        const int mine = __popc(bits);
        // Exclusive prefix sum of the lanes' counts.
        int incl = mine;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int up = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += up;
        }
        int pos = count + incl - mine;
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
            if ((bits >> q) & 1u) {
                if (pos < cap) {
                    indices[slot0 + pos] = static_cast<uint8_t>(c + q);
                    values[slot0 + pos] = v[q];
                }
                ++pos;
            }
        }
        count += __shfl_sync(FULL_MASK, incl, 31);
    }
    if (lane == 0) counts[w] = static_cast<uint32_t>(count);
}

// Fills n 16-bit words with `bits` (tests poison outputs with a NaN pattern).
extern "C" __global__ void twell_fill_u16(uint16_t* __restrict__ p, long long n, uint16_t bits) {
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        p[i] = bits;
}

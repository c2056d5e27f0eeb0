// gate_pack: relu(gate) packed into TwELL. The gate GEMM itself runs on cuBLAS; this
// kernel reads its bf16 output once and keeps the values > 0.
//
// One warp per (row, tile) (the 16-byte kernel below: PACK_UNITS of them). Lanes read
// 32 consecutive columns at a time, a ballot ranks the positive ones, and each writes
// its slot. A tile with more nonzeros than slots gets its true count (> capacity);
// consumers then read that tile from the dense gate instead, so nothing is lost.
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

// The bits of the 8 bf16 in `raw` that compare > 0 as floats: the patterns 0x0001 up to
// 0x7F80 (+inf), found two at a time on the integer pipes (h - 1 wraps 0 to 0xFFFF),
// instead of eight conversions and compares.
__device__ __forceinline__ uint32_t positive_bits(const uint4& raw) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lt = __vcmpltu2(__vsub2(words[i], 0x00010001u), 0x7F807F80u);
        bits |= ((lt & 1u) | ((lt >> 15) & 2u)) << (2 * i);
    }
    return bits;
}

// The q-th bf16 of `raw` (q not known at compile time: selects, not an indexed array,
// which would go to local memory).
__device__ __forceinline__ __nv_bfloat16 bf16_at(const uint4& raw, int q) {
    const uint32_t word = q < 2 ? raw.x : q < 4 ? raw.y : q < 6 ? raw.z : raw.w;
    const unsigned short h = static_cast<unsigned short>((q & 1) ? word >> 16 : word & 0xFFFFu);
    return __ushort_as_bfloat16(h);
}

// The same with 16-byte loads, for d_ff % 8 == 0 (then every row and tile start is
// 16-byte aligned) and tiles of at most 256 columns (u8 indices): a lane reads its 8
// columns of a tile at once, ranks its positives with a warp prefix sum, and writes its
// slots, visiting only its set bits (an eight-step loop per lane before: 13% of the
// pack at 3% density on the H200). The compares run two at a time on the integer pipes,
// and the (row, tile) split is 32-bit (the host checks M · n_tiles < 2^32).
//
// A warp takes PACK_UNITS consecutive (row, tile) units and issues all their loads
// before it ranks any: one 16-byte load in flight per lane left the pack at about half
// of the memory's bandwidth (45 µs for 8192 x 5632 on the H200).
#define PACK_UNITS 4
extern "C" __global__ void twell_gate_pack_vec_bf16(
    const __nv_bfloat16* __restrict__ gate,  // [M, f]
    uint32_t* __restrict__ counts,           // [M, n_tiles]
    uint8_t* __restrict__ indices,           // [M, n_tiles, cap]
    __nv_bfloat16* __restrict__ values,      // [M, n_tiles, cap]
    int M, int f, int tile, int cap, int n_tiles) {
    const long long total = static_cast<long long>(M) * n_tiles;
    const long long first = global_warp() * PACK_UNITS;
    const int lane = threadIdx.x & 31;
    if (first >= total) return;
    const int c = lane * VEC;  // this lane's first column in every tile
    uint4 raw[PACK_UNITS];
#pragma unroll
    for (int u = 0; u < PACK_UNITS; ++u) {
        raw[u] = make_uint4(0u, 0u, 0u, 0u);
        const long long wl = first + u;
        if (wl < total) {
            const unsigned w = static_cast<unsigned>(wl);
            const unsigned row = w / static_cast<unsigned>(n_tiles);
            const int c0 = static_cast<int>(w - row * static_cast<unsigned>(n_tiles)) * tile;
            if (c < min(tile, f - c0))
                raw[u] = *reinterpret_cast<const uint4*>(gate + static_cast<long long>(row) * f + c0 + c);
        }
    }
#pragma unroll
    for (int u = 0; u < PACK_UNITS; ++u) {
        const long long wl = first + u;
        if (wl >= total) break;  // the same in every lane
        uint32_t bits = positive_bits(raw[u]);
        const int mine = __popc(bits);
        // Inclusive prefix sum of the lanes' counts.
        int incl = mine;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int up = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += up;
        }
        const long long slot0 = wl * cap;
        for (int pos = incl - mine; bits != 0 && pos < cap; ++pos) {
            const int q = __ffs(bits) - 1;
            bits &= bits - 1;
            indices[slot0 + pos] = static_cast<uint8_t>(c + q);
            values[slot0 + pos] = bf16_at(raw[u], q);
        }
        if (lane == 31) counts[wl] = static_cast<uint32_t>(incl);
    }
}

// Fills n 16-bit words with `bits` (tests poison outputs with a NaN pattern).
extern "C" __global__ void twell_fill_u16(uint16_t* __restrict__ p, long long n, uint16_t bits) {
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        p[i] = bits;
}

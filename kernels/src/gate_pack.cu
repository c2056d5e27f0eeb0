// gate_pack: relu(gate) packed into TwELL. The gate GEMM itself runs on cuBLAS; this
// kernel reads its bf16 output once and keeps the values > 0.
//
// One warp per (row, tile) (the 16-byte kernel below: PACK_UNITS of them). Lanes read
// 32 consecutive columns at a time, a ballot ranks the positive ones, and each writes
// its slot. A tile with more nonzeros than slots gets its true count (> capacity);
// consumers then read that tile from the dense gate instead, so nothing is lost.
#include "common.cuh"

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

// The bits of the 8 bf16 in `raw` that compare > 0 as floats (bit q: column q), two at a
// time on the integer pipes instead of eight conversions and compares. A 16-bit pattern h
// is 0x0001 up to 0x7F80 (+inf) exactly when its top bit is clear, h + 0x7FFF sets it
// (h >= 1) and h + 0x007F does not (h <= 0x7F80); the halves add without carries between
// them. The eight flags (bit 15 or 31 of a word) are then gathered byte-wise (`prmt`) and
// packed by one multiply each four: 27 instructions a lane on sm_90 against about 40 for
// compares through `__vcmpltu2` (the pack is bound by instruction issue at a few thousand
// rows).
__device__ __forceinline__ uint32_t positive_bits(const uint4& raw) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t flags[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        flags[i] = __vadd2(words[i], 0x7FFF7FFFu) & ~__vadd2(words[i], 0x007F007Fu) & ~words[i] & 0x80008000u;
    // Bytes 1 and 3 of two words, in column order: the flags at bits 7, 15, 23, 31.
    const uint32_t lo = __byte_perm(flags[0], flags[1], 0x7531);
    const uint32_t hi = __byte_perm(flags[2], flags[3], 0x7531);
    // Bits 0, 8, 16, 24 times 0x01020408 land on bits 24-27 with no carries.
    auto four = [](uint32_t g) { return (((g >> 7) & 0x01010101u) * 0x01020408u) >> 24; };
    return four(lo) | (four(hi) << 4);
}

// The q-th bf16 of `raw` (q not known at compile time: selects, not an indexed array,
// which would go to local memory).
__device__ __forceinline__ __nv_bfloat16 bf16_at(const uint4& raw, int q) {
    const uint32_t word = q < 2 ? raw.x : q < 4 ? raw.y : q < 6 ? raw.z : raw.w;
    const unsigned short h = static_cast<unsigned short>((q & 1) ? word >> 16 : word & 0xFFFFu);
    return __ushort_as_bfloat16(h);
}

// The rows and the places within their rows of UNITS consecutive work units from unit
// `first`, `per_row` units a row: one 32-bit division for the first, then steps along the
// row (a division per unit was most of a pack's instructions). Both packs split their
// work this way: (row, tile) units in the vector pack, (row, 32-word group) in the mask
// pack.
template <int UNITS>
__device__ __forceinline__ void unit_places(unsigned first, unsigned per_row, unsigned* rows, int* within) {
    unsigned row = first / per_row;
    int k = static_cast<int>(first - row * per_row);
#pragma unroll
    for (int u = 0; u < UNITS; ++u) {
        rows[u] = row;
        within[u] = k;
        if (++k == static_cast<int>(per_row)) {
            k = 0;
            ++row;
        }
    }
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
    // The first unit's (row, tile) by one division; the next units step along the row.
    // Every load is issued before any unit is ranked, unconditionally, from a clamped
    // address (a unit past the end, or a lane past its tile, reads the gate's first 16
    // bytes), then zeroed: loads behind branches, or the first unit's ranking scheduled
    // between them, would wait for L2 once a unit.
    unsigned rows[PACK_UNITS];
    int tiles[PACK_UNITS];
    unit_places<PACK_UNITS>(static_cast<unsigned>(first), static_cast<unsigned>(n_tiles), rows, tiles);
    uint4 raw[PACK_UNITS];
    bool ok[PACK_UNITS];
#pragma unroll
    for (int u = 0; u < PACK_UNITS; ++u) {
        const int c0 = tiles[u] * tile;
        ok[u] = first + u < total && c < min(tile, f - c0);
        const long long at = ok[u] ? static_cast<long long>(rows[u]) * f + c0 + c : 0;
        raw[u] = *reinterpret_cast<const uint4*>(gate + at);
    }
#pragma unroll
    for (int u = 0; u < PACK_UNITS; ++u) {
        const long long wl = first + u;
        if (wl >= total) break;  // the same in every lane
        uint32_t bits = ok[u] ? positive_bits(raw[u]) : 0u;
        const int mine = __popc(bits);
        // Inclusive prefix sum of the lanes' counts: at low density no lane holds two
        // positives, and the rank is a count of the lanes below with one.
        const uint32_t holding = __ballot_sync(FULL_MASK, mine != 0);
        const int incl = __all_sync(FULL_MASK, mine <= 1) ? __popc(holding & (FULL_MASK >> (31 - lane)))
                                                          : warp_inclusive_sum(mine);
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

// The bit mask of a plain gate's positives (bit j of row r set where g[r, j] > 0 as bf16,
// the packs' test), in the layout cuBLASLt's ReLU epilogue writes (`words_per_row` u32
// words a row, LSB first; the words past the row's columns zero): for the row kernels that
// walk a mask (`walk_mask_row`) where the gate came from `cublasGemmEx`, which writes none.
// Nothing is ranked and no slot written, so where the gate is still in L2 (a few thousand
// rows) this is a fraction of a pack. A warp turns (row, 256-column chunk) units into 8
// words each, SIGN_UNITS units a warp with their 16-byte loads issued before any is
// turned; d_ff % 8 == 0 (16-byte rows), units numbered in 32 bits (the host checks).
#define SIGN_UNITS 4
extern "C" __global__ void twell_gate_sign_mask_bf16(const __nv_bfloat16* __restrict__ gate,  // [M, f]
                                                     uint32_t* __restrict__ mask,  // [M, words_per_row]
                                                     int M, int f, int words_per_row) {
    const int lane = threadIdx.x & 31;
    const int chunks = (f + 255) >> 8;
    const unsigned total = static_cast<unsigned>(M) * static_cast<unsigned>(chunks);
    const long long first_wide = global_warp() * SIGN_UNITS;
    if (first_wide >= total) return;
    const unsigned first = static_cast<unsigned>(first_wide);
    unsigned rows[SIGN_UNITS];
    int chunk[SIGN_UNITS];
    unit_places<SIGN_UNITS>(first, static_cast<unsigned>(chunks), rows, chunk);
    const int c = lane * VEC;  // this lane's first column in every chunk
    uint4 raw[SIGN_UNITS];
    bool ok[SIGN_UNITS];
#pragma unroll
    for (int u = 0; u < SIGN_UNITS; ++u) {
        const int col = chunk[u] * 256 + c;
        ok[u] = first + u < total && col < f;
        const long long at = ok[u] ? static_cast<long long>(rows[u]) * f + col : 0;
        raw[u] = *reinterpret_cast<const uint4*>(gate + at);
    }
#pragma unroll
    for (int u = 0; u < SIGN_UNITS; ++u) {
        if (first + u >= total) break;  // the same in every lane
        const uint32_t byte = ok[u] ? positive_bits(raw[u]) : 0u;
        // Word k of the chunk holds lanes 4k .. 4k + 3's columns, lane 4k's lowest.
        const int src = 4 * (lane & 7);
        const uint32_t b0 = __shfl_sync(FULL_MASK, byte, src), b1 = __shfl_sync(FULL_MASK, byte, src + 1),
                       b2 = __shfl_sync(FULL_MASK, byte, src + 2), b3 = __shfl_sync(FULL_MASK, byte, src + 3);
        const int word = chunk[u] * 8 + lane;
        if (lane < 8 && word < words_per_row)
            mask[static_cast<long long>(rows[u]) * words_per_row + word] = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
    }
}

// The pack from the bit mask of the positives that cuBLASLt's ReLU epilogue writes beside
// the gate (CUBLASLT_EPILOGUE_RELU_AUX): the gate is read only where a bit is set, so the
// pack reads m · f / 8 bytes of mask and a sector per nonzero instead of all m · f · 2
// bytes of gate (92 MB at 8192 x 5632: 38 µs of a 4 x 2048 prefill layer on the H200).
//
// Mask layout (column-major D = G^T, leading dimension in bits): token row r's bits start
// at word r · words_per_row, bit j of the row is neuron j, LSB first in each u32 word.
// Lane l of a warp takes one 32-neuron word; a tile is `tile / 32` consecutive words,
// so a warp covers 32 / (tile / 32) whole tiles of one row. Only values that are > 0 as
// bf16 are listed (a bit set for a value that rounded to zero is dropped), so the pattern
// is the one `twell_gate_pack_vec_bf16` finds in the same gate. Overflow as there: the
// true count, the slots past capacity left out, the dense gate read later.
//
// A warp takes MASK_UNITS consecutive (row, 32-word) units (a row of 5632 neurons is 6)
// and issues every mask load, then each lane's first flagged value of every unit, before
// it ranks any: at low density a lane has at most one bit set, so the pack is two rounds
// of independent loads instead of a chain of them.
#define MASK_UNITS 8
__device__ __forceinline__ bool bf16_positive(__nv_bfloat16 v) {
    const unsigned short h = __bfloat16_as_ushort(v);
    return static_cast<unsigned short>(h - 1u) < 0x7F80u;
}
extern "C" __global__ void twell_gate_pack_mask_bf16(
    const __nv_bfloat16* __restrict__ gate,  // [M, f], relu applied
    const uint32_t* __restrict__ mask,       // [M, words_per_row]
    uint32_t* __restrict__ counts,           // [M, n_tiles]
    uint8_t* __restrict__ indices,           // [M, n_tiles, cap]
    __nv_bfloat16* __restrict__ values,      // [M, n_tiles, cap]
    int M, int f, int tile, int cap, int n_tiles, int words_per_row) {
    const int lane = threadIdx.x & 31;
    const int words_per_tile = tile >> 5;  // a power of two
    const int tile_shift = __ffs(words_per_tile) - 1;
    const int row_words = (f + 31) >> 5;
    const int groups = (row_words + 31) >> 5;  // warps' worth of words in a row
    // Units in 32 bits (the host checks M · groups < 2^32), and one division a warp: a
    // 64-bit division per unit was most of this kernel's instructions.
    const unsigned total = static_cast<unsigned>(M) * static_cast<unsigned>(groups);
    const long long first_wide = global_warp() * MASK_UNITS;
    if (first_wide >= total) return;
    const unsigned first = static_cast<unsigned>(first_wide);
    unsigned rows[MASK_UNITS];
    int words[MASK_UNITS];  // this lane's word of the row in each unit
    unit_places<MASK_UNITS>(first, static_cast<unsigned>(groups), rows, words);
#pragma unroll
    for (int u = 0; u < MASK_UNITS; ++u) words[u] = words[u] * 32 + lane;
    uint32_t bits[MASK_UNITS];
#pragma unroll
    for (int u = 0; u < MASK_UNITS; ++u) {
        bits[u] = 0u;
        if (first + u < total && words[u] < row_words) {
            bits[u] = mask[static_cast<long long>(rows[u]) * words_per_row + words[u]];
            const int left = f - words[u] * 32;
            if (left < 32) bits[u] &= (1u << left) - 1u;
        }
    }
    __nv_bfloat16 lead[MASK_UNITS];  // the value of each unit's lowest set bit
#pragma unroll
    for (int u = 0; u < MASK_UNITS; ++u)
        lead[u] = bits[u] != 0u
                      ? gate[static_cast<long long>(rows[u]) * f + words[u] * 32 + __ffs(bits[u]) - 1]
                      : __float2bfloat16(0.f);
#pragma unroll
    for (int u = 0; u < MASK_UNITS; ++u) {
        if (first + u >= total) break;  // the same in every lane
        const long long row = rows[u];
        const int word = words[u];
        const __nv_bfloat16* src = gate + row * f + word * 32;
        const int q_lead = __ffs(bits[u]) - 1;
        uint32_t keep = 0u;
        if (bits[u] != 0u) {
            if (bf16_positive(lead[u])) keep = 1u << q_lead;
            for (uint32_t b = bits[u] & (bits[u] - 1u); b != 0u; b &= b - 1u) {
                const int q = __ffs(b) - 1;
                if (bf16_positive(src[q])) keep |= 1u << q;
            }
        }
        const int mine = __popc(keep);
        // Inclusive prefix sum over the lanes of this tile.
        const int in_tile = lane & (words_per_tile - 1);
        int incl = mine;
        for (int o = 1; o < words_per_tile; o <<= 1) {
            const int up = __shfl_up_sync(FULL_MASK, incl, o, words_per_tile);
            if (in_tile >= o) incl += up;
        }
        const int t = word >> tile_shift;
        if (t >= n_tiles) continue;  // past the row's last tile: no shuffles follow
        const long long unit_slot = row * n_tiles + t;
        const long long slot0 = unit_slot * cap;
        const int c0 = in_tile * 32;  // this word's first column in its tile
        int pos = incl - mine;
        for (uint32_t b = keep; b != 0u && pos < cap; b &= b - 1u, ++pos) {
            const int q = __ffs(b) - 1;
            indices[slot0 + pos] = static_cast<uint8_t>(c0 + q);
            values[slot0 + pos] = q == q_lead ? lead[u] : src[q];
        }
        // A tile never straddles two warps' words (tile / 32 divides 32): its last lane
        // is here, and holds the tile's total.
        if (in_tile == words_per_tile - 1) counts[unit_slot] = static_cast<uint32_t>(incl);
    }
}

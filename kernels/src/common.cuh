// Shared helpers of the kernels: bf16 vectors, warp reductions, the TwELL layout constants.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

// Elements of d per lane-step: one 16-byte vector of 8 bf16.
#define VEC 8
// d-elements one warp covers per step of the down projection (32 lanes x 8).
#define WARP_CHUNK 256
// An MLP op's result for M tokens is the [M, d] output rows, then the M L1 terms
// (`Σ_j |h_j|` per token): the output is contiguous, and the L1 term rides along in the
// same tensor (a CustomOp has one output) for its gradient.
__device__ __forceinline__ long long l1_at(int M, int d, long long row) {
    return static_cast<long long>(M) * d + row;
}

// A float rounded to bf16 and back: where a kernel must see the value a bf16 tensor
// (the cuBLAS gate of the other paths) would hold.
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Inclusive prefix sum of v over the warp's lanes: lane i gets the sum of lanes 0 ..= i.
// Every lane of the warp must call it.
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T up = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += up;
    }
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

// RoPE's turn of one pair of dims (x1 at i < hd/2, x2 at i + hd/2) by the angle whose
// cos and sin are co and sn (rotate-half, as HF Llama), in f32. The fused multiply-adds
// are spelt out so every kernel that turns q or k (rope.cu, the attention kernels)
// rounds the same way: the attention that turns its queries itself gives exactly what
// rope.cu's queries would.
__device__ __forceinline__ void rope_turn(float x1, float x2, float co, float sn, float& o1, float& o2) {
    o1 = fmaf(x1, co, -x2 * sn);
    o2 = fmaf(x1, sn, x2 * co);
}

// Adds into global memory without asking for the old value back. `atomicAdd` on a float
// compiles to a returning atomic even when the value is unused, and those cost the
// one-token MLP kernel 5 of its 19 us (H200, ncu).
__device__ __forceinline__ void red_add(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void red_add(uint32_t* p, uint32_t v) {
    asm volatile("red.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add(unsigned long long* p, unsigned long long v) {
    asm volatile("red.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Asks L2 for the 128-byte line at p.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float* in) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(in[2 * k], in[2 * k + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
}

// Σ_i a_i · b_i over the 8 bf16 pairs of two 16-byte vectors, added to acc.
__device__ __forceinline__ float dot8_acc(const uint4& a, const uint4& b, float acc) {
    const __nv_bfloat162* ah = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float2 af = __bfloat1622float2(ah[q]);
        const float2 bf = __bfloat1622float2(bh[q]);
        acc = fmaf(af.x, bf.x, fmaf(af.y, bf.y, acc));
    }
    return acc;
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

// A row of d bf16 (d % 8 == 0) in registers, for one warp: lane l holds the 16-byte
// vectors l, l + 32, ... (MAXV of them, zero past d).
template <int MAXV>
__device__ __forceinline__ void row_to_registers(const __nv_bfloat16* __restrict__ src, int d, uint4* r) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
        const int e = (lane + 32 * i) * VEC;
        r[i] = e < d ? *reinterpret_cast<const uint4*>(src + e) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// The RMS norm of a row held as `row_to_registers` leaves it, with a weight of one, in
// place: each value becomes bf16(v · rsqrt(mean(v²) + eps)), what `add_rms_norm` stores
// for a unit weight (the sum of squares reduced in a warp's order, not a block's).
// Returns the scale, the same in every lane.
template <int MAXV>
__device__ __forceinline__ float normalize_registers(uint4* r, int d, float eps) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
        const __nv_bfloat162* rh = reinterpret_cast<const __nv_bfloat162*>(&r[i]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 v = __bfloat1622float2(rh[q]);
            ss = fmaf(v.x, v.x, ss);
            ss = fmaf(v.y, v.y, ss);
        }
    }
    const float scale = rsqrtf(warp_sum(ss) / d + eps);
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
        __nv_bfloat162* rh = reinterpret_cast<__nv_bfloat162*>(&r[i]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 v = __bfloat1622float2(rh[q]);
            rh[q] = __floats2bfloat162_rn(scale * v.x, scale * v.y);
        }
    }
    return scale;
}

// r . w over d, for a row r held as `row_to_registers` leaves it. The loop is unrolled,
// so all of the warp's loads of w are in flight at once. The result is in every lane.
template <int MAXV>
__device__ __forceinline__ float registers_dot(const uint4* r, const __nv_bfloat16* __restrict__ w, int d) {
    const int lane = threadIdx.x & 31;
    // Four partial sums: one would chain all 8·MAXV multiply-adds of a lane, each waiting
    // on the last, after the loads have arrived.
    float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
        const int e = (lane + 32 * i) * VEC;
        if (e < d) {
            float b[VEC];
            load8(w + e, b);
            const __nv_bfloat162* rh = reinterpret_cast<const __nv_bfloat162*>(&r[i]);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 rf = __bfloat1622float2(rh[q]);
                part[q] = fmaf(rf.x, b[2 * q], part[q]);
                part[q] = fmaf(rf.y, b[2 * q + 1], part[q]);
            }
        }
    }
    return warp_sum((part[0] + part[1]) + (part[2] + part[3]));
}

// Adds x to this lane's online-softmax state: m the running max, l the sum of exp(· - m).
__device__ __forceinline__ void online_max_sum(float& m, float& l, float x) {
    if (x > m) {
        l = l * __expf(m - x) + 1.f;
        m = x;
    } else {
        l += __expf(x - m);
    }
}

// Merges another lane's online-softmax state (running max m2, sum l2 of exp(x - m2)) into
// this one's; a lane that saw nothing holds (-inf, 0) and changes nothing.
__device__ __forceinline__ void merge_max_sum(float& m, float& l, float m2, float l2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) {
        m = m2;
        l = l2;
        return;
    }
    const float mx = fmaxf(m, m2);
    l = l * __expf(m - mx) + l2 * __expf(m2 - mx);
    m = mx;
}

// The online-softmax states of a block of THREADS threads merged, in every thread (a
// block per row). Calls may follow each other: each ends on a barrier.
template <int THREADS>
__device__ __forceinline__ void block_max_sum(float& m, float& l) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(FULL_MASK, m, o);
        const float l2 = __shfl_xor_sync(FULL_MASK, l, o);
        merge_max_sum(m, l, m2, l2);
    }
    __shared__ float2 partial[THREADS / 32];
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = make_float2(m, l);
    __syncthreads();
    float mm = -INFINITY, ll = 0.f;
    for (int w = 0; w < THREADS / 32; ++w) merge_max_sum(mm, ll, partial[w].x, partial[w].y);
    __syncthreads();
    m = mm;
    l = ll;
}

__device__ __forceinline__ long long global_warp() {
    return (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
}

// The lane whose share of a warp's pairs holds pair k, each lane holding the inclusive
// prefix sum `incl` of the lanes' pair counts: how many lanes' shares end at or before k
// (31 for k at or past the total), by a binary search over the nondecreasing sums, each
// lane for its own k. Every lane of the warp must call it.
__device__ __forceinline__ int lane_of_pair(int incl, int k) {
    int at = 0;
#pragma unroll
    for (int step = 16; step > 0; step >>= 1) {
        if (__shfl_sync(FULL_MASK, incl, at + step - 1) <= k) at += step;
    }
    return at;
}

// Walks tiles [t_begin, t_end) of one token row of a TwELL gate, for a whole warp, 32
// tiles at a time: each tile's count is read by its own lane, the listed slots of the 32
// tiles are flattened into blocks of up to 32 pairs in (tile, slot) order, and for each
// block `block(j, v, slot, n)` runs with lane k holding the block's k-th pair: its neuron
// j, value v and value-array index (-1 for lanes past the block's n pairs). Then, for
// each overflowing tile of the 32, `spilled(c0, width)` runs with the tile's first column
// and width. Why flattened: at 0.5-1% density a tile lists one or two slots, and a block
// per tile read a token's slot lists one tile after another, each read waiting on the
// last; reading up to 32 pairs' slots at once took 4-6% off the prefill MLP at 0.5% and
// 1% from 16,384 rows (H200).
template <class Block, class Spilled>
__device__ __forceinline__ void walk_pairs(const uint32_t* __restrict__ counts, const uint8_t* __restrict__ indices,
                                           const __nv_bfloat16* values, long long row, int t_begin, int t_end,
                                           int tile, int cap, int n_tiles, int f, Block block, Spilled spilled) {
    const int lane = threadIdx.x & 31;
    for (int tb = t_begin; tb < t_end; tb += 32) {
        const int t = tb + lane;
        const int c = t < t_end ? static_cast<int>(counts[row * n_tiles + t]) : 0;
        const int listed = c <= cap ? c : 0;
        // Inclusive prefix sum of the listed counts over the chunk's tiles.
        const int incl = warp_inclusive_sum(listed);
        const int excl = incl - listed;
        const int total = __shfl_sync(FULL_MASK, incl, 31);
        for (int kb = 0; kb < total; kb += 32) {
            const int k = kb + lane;
            // The tile of pair k: how many tiles end at or before it.
            const int at = lane_of_pair(incl, k);
            const int first = __shfl_sync(FULL_MASK, excl, at);  // at <= 31
            int j = 0;
            float v = 0.f;
            long long slot = -1;
            if (k < total) {
                slot = (row * n_tiles + tb + at) * static_cast<long long>(cap) + (k - first);
                j = (tb + at) * tile + indices[slot];
                v = __bfloat162float(values[slot]);
            }
            block(j, v, slot, min(32, total - kb));
        }
        uint32_t over = __ballot_sync(FULL_MASK, c > cap);
        while (over) {
            const int b = __ffs(over) - 1;
            over &= over - 1;
            const int c0 = (tb + b) * tile;
            spilled(c0, min(tile, f - c0));
        }
    }
}

// For an overflowing tile read from the dense h (`width` columns from `src`), calls
// `add(c, h)` for each nonzero h = src[c], in column order, with the same (c, h) on
// every lane: the warp reads 32 columns at a time and visits what its ballot finds.
template <class Add>
__device__ __forceinline__ void each_dense_nonzero(const __nv_bfloat16* __restrict__ src, int width, Add add) {
    const int lane = threadIdx.x & 31;
    for (int k = 0; k < width; k += 32) {
        const int col = k + lane;
        const float hv = col < width ? __bfloat162float(src[col]) : 0.f;
        uint32_t mask = __ballot_sync(FULL_MASK, hv != 0.f);
        while (mask) {
            const int q = __ffs(mask) - 1;
            mask &= mask - 1;
            add(k + q, __shfl_sync(FULL_MASK, hv, q));
        }
    }
}

// All tiles of one token row (`walk_pairs` over [0, n_tiles)).
template <class Block, class Spilled>
__device__ __forceinline__ void walk_row(const uint32_t* __restrict__ counts, const uint8_t* __restrict__ indices,
                                         const __nv_bfloat16* values, long long row, int tile, int cap,
                                         int n_tiles, int f, Block block, Spilled spilled) {
    walk_pairs(counts, indices, values, row, 0, n_tiles, tile, cap, n_tiles, f, block, spilled);
}

// Walks one token row's active neurons straight from the gate GEMM's ReLU bit mask (bit
// j % 32 of word j / 32 set where g_j > 0; `words_per_row` words a row, the bits past f
// unspecified), with no TwELL slots in between: `block(j, v, slot, n)` runs as under
// `walk_pairs`, lane k holding the k-th of up to 32 pairs, in column order, with v =
// gate_row[j] and slot = j (-1 past the n pairs), the pair's place in the gate row, where
// the up kernel leaves h and the down kernel reads it. A lane reads 8 consecutive words a
// round (a warp 8,192 columns), so a row costs one round of mask loads and then one of
// value loads, as the slots did after a pack. The words wait in shared memory (1 KB a
// warp; blocks of at most 8 warps) rather than registers while `block` runs. With
// `counts_row` each lane also stores the set bits of each whole tile of `tile_words` (1,
// 2, 4 or 8) words among its 8: the counts a pack writes, so density and overflow read
// the same.
template <class Block>
__device__ __forceinline__ void walk_mask_row(const uint32_t* __restrict__ row_mask, int words_per_row, int f,
                                              const __nv_bfloat16* gate_row, uint32_t* __restrict__ counts_row,
                                              int tile_words, Block block) {
    __shared__ uint32_t kept_words[8][256];
    uint32_t* mine = kept_words[threadIdx.x >> 5];
    const int lane = threadIdx.x & 31;
    const int row_words = (f + 31) >> 5;
    for (int wb = 0; wb < row_words; wb += 256) {
        const int w0 = wb + 8 * lane;
        uint32_t words[8];
        if (w0 + 8 <= words_per_row) {
            // Rows start 16-byte aligned (words_per_row is a multiple of 4) and w0 is a
            // multiple of 8: two 16-byte loads.
            const uint4* src = reinterpret_cast<const uint4*>(row_mask + w0);
            const uint4 lo = src[0], hi = src[1];
            words[0] = lo.x, words[1] = lo.y, words[2] = lo.z, words[3] = lo.w;
            words[4] = hi.x, words[5] = hi.y, words[6] = hi.z, words[7] = hi.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) words[i] = w0 + i < row_words ? row_mask[w0 + i] : 0u;
        }
        int sum = 0, in_tile = 0;
        __syncwarp();  // the previous round's reads of `mine` are done
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int left = f - (w0 + i) * 32;  // columns of the row from this word on
            uint32_t bits = words[i];
            if (left <= 0) bits = 0u;
            else if (left < 32) bits &= (1u << left) - 1u;
            mine[8 * lane + i] = bits;
            sum += __popc(bits);
            in_tile += __popc(bits);
            if (((i + 1) & (tile_words - 1)) == 0) {
                const int first = w0 + i + 1 - tile_words;  // the tile's first word
                if (counts_row != nullptr && first * 32 < f)
                    counts_row[first / tile_words] = static_cast<uint32_t>(in_tile);
                in_tile = 0;
            }
        }
        __syncwarp();
        const int incl = warp_inclusive_sum(sum);
        const int excl = incl - sum;
        const int total = __shfl_sync(FULL_MASK, incl, 31);
        for (int kb = 0; kb < total; kb += 32) {
            const int k = kb + lane;
            // The lane whose words hold pair k, then the word among its 8, then the bit.
            const int at = lane_of_pair(incl, k);
            int r = k - __shfl_sync(FULL_MASK, excl, at);
            float v = 0.f;
            long long slot = -1;
            int j = 0;
            if (k < total) {
                int i = 0;
                uint32_t bits = mine[8 * at];
                while (r >= __popc(bits)) {  // k < total: the pair is among lane at's words
                    r -= __popc(bits);
                    bits = mine[8 * at + ++i];
                }
                for (int q = 0; q < r; ++q) bits &= bits - 1u;  // drop the r lowest set bits
                j = (wb + 8 * at + i) * 32 + __ffs(bits) - 1;
                v = __bfloat162float(gate_row[j]);
                slot = j;
            }
            block(j, v, slot, min(32, total - kb));
        }
    }
}

// A token row split over `split` consecutive warps of one block: this warp's part and
// its tiles [t_begin, t_end) (contiguous, as even as the tile count allows).
struct RowPart {
    long long row;
    int part, t_begin, t_end;
    __device__ __forceinline__ RowPart(int split, int n_tiles) {
        const long long w = global_warp();
        if (split == 1) {
            row = w;
            part = 0;
            t_begin = 0;
            t_end = n_tiles;
            return;
        }
        row = w / split;
        part = static_cast<int>(w % split);
        const int per = (n_tiles + split - 1) / split;
        t_begin = min(n_tiles, part * per);
        t_end = min(n_tiles, t_begin + per);
    }
};

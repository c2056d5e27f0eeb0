// gated_t2d: the sparse up and down projections of a TwELL gate.
//
//   up   (SDDMM): h_ij = g_ij * (x_i . Wu_j) for each active (i, j), written over g
//   down (SpMM) : out_i = sum_j h_ij * Wd_j, and out_i[d] = sum_j |h_ij| (the L1 term)
//
// Weights are neuron-major: row j of w_ud [f, 2d] is [Wu_j | Wd_j], so each active
// neuron costs two contiguous 2d-byte reads. Overflowing tiles (count > capacity) are
// read from the dense gate, where the up kernel also leaves their h.
//
// Work is split so that every size fills the GPU. The row kernels give a token row to a
// warp, or to up to 8 warps of a block (`RowPart`) where rows are few. The slot kernels
// (rows too wide for the row kernels' registers) give a warp a whole tile (up) or a whole
// row chunk (down) for many tokens, and for few tokens one slot (up) or one tile of one
// chunk (down), the partial sums meeting in f32 atomics.
#include "common.cuh"

// Warps per block of the row kernels (256 threads: `BLOCK_THREADS` on the host); a split
// row's parts must share a block, so the split divides it.
#define ROW_BLOCK_WARPS 8

extern "C" __global__ void gated_t2d_up_bf16(
    const __nv_bfloat16* __restrict__ x,      // [M, d]
    const __nv_bfloat16* __restrict__ w_ud,   // [f, 2d]
    const uint32_t* __restrict__ counts,      // [M, n_tiles]
    const uint8_t* __restrict__ indices,      // [M, n_tiles, cap]
    __nv_bfloat16* __restrict__ values,       // [M, n_tiles, cap]: g in, h out
    __nv_bfloat16* __restrict__ gate,         // [M, f]: overflow tiles become h
    float* __restrict__ l1,                   // [M], zeroed
    __nv_bfloat16* __restrict__ u_out,        // [M, n_tiles, cap]: u of listed slots, or null
    int M, int d, int f, int tile, int cap, int n_tiles, int slots_per_warp) {
    const int groups = cap / slots_per_warp;
    const long long w = global_warp();
    const int lane = threadIdx.x & 31;
    if (w >= static_cast<long long>(M) * n_tiles * groups) return;
    const int grp = static_cast<int>(w % groups);
    const long long rt = w / groups;  // (row, tile)
    const long long row = rt / n_tiles;
    const int t = static_cast<int>(rt % n_tiles);
    const int count = static_cast<int>(counts[rt]);
    const __nv_bfloat16* xr = x + row * d;
    float l1_acc = 0.f;
    if (count <= cap) {
        const int s1 = min(count, (grp + 1) * slots_per_warp);
        for (int s = grp * slots_per_warp; s < s1; ++s) {
            const long long slot = rt * cap + s;
            const int j = t * tile + indices[slot];
            const float g = __bfloat162float(values[slot]);
            const float u = warp_dot(xr, w_ud + static_cast<long long>(j) * 2 * d, d);
            const __nv_bfloat16 h = __float2bfloat16(g * u);
            l1_acc += fabsf(__bfloat162float(h));
            if (lane == 0) {
                values[slot] = h;
                if (u_out) u_out[slot] = __float2bfloat16(u);
            }
        }
    } else if (grp == 0) {
        const int c0 = t * tile;
        const int width = min(tile, f - c0);
        __nv_bfloat16* src = gate + row * f + c0;
        for (int k = 0; k < width; k += 32) {
            const int c = k + lane;
            const float g = c < width ? __bfloat162float(src[c]) : 0.f;
            uint32_t mask = __ballot_sync(FULL_MASK, g > 0.f);
            // Non-positive gates are dropped (the ReLU), so the tile reads as h after.
            if (c < width && !(g > 0.f)) src[c] = __float2bfloat16(0.f);
            while (mask) {
                const int b = __ffs(mask) - 1;
                mask &= mask - 1;
                const float gb = __shfl_sync(FULL_MASK, g, b);
                const int j = c0 + k + b;
                const float u = warp_dot(xr, w_ud + static_cast<long long>(j) * 2 * d, d);
                const __nv_bfloat16 h = __float2bfloat16(gb * u);
                l1_acc += fabsf(__bfloat162float(h));
                if (lane == b) src[k + b] = h;
            }
        }
    }
    if (lane == 0 && l1_acc != 0.f) atomicAdd(l1 + row, l1_acc);
}

// Adds h * Wd_j[e0 .. e0 + 8) to acc.
__device__ __forceinline__ void axpy8(float h, const __nv_bfloat16* __restrict__ wd, float* acc) {
    float w[VEC];
    load8(wd, w);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = fmaf(h, w[k], acc[k]);
}

extern "C" __global__ void gated_t2d_down_bf16(
    const __nv_bfloat16* __restrict__ w_ud,    // [f, 2d]
    const uint32_t* __restrict__ counts,       // [M, n_tiles]
    const uint8_t* __restrict__ indices,       // [M, n_tiles, cap]
    const __nv_bfloat16* __restrict__ values,  // [M, n_tiles, cap]: h
    const __nv_bfloat16* __restrict__ gate,    // [M, f]: h of overflow tiles
    const float* __restrict__ l1,              // [M]
    float* __restrict__ acc_out,               // [M, d] f32, used when tile_groups > 1
    __nv_bfloat16* __restrict__ out,           // [M, d] rows, then M L1 terms
    int M, int d, int f, int tile, int cap, int n_tiles, int tile_groups) {
    const int n_chunks = (d + WARP_CHUNK - 1) / WARP_CHUNK;
    const long long w = global_warp();
    const int lane = threadIdx.x & 31;
    if (w >= static_cast<long long>(M) * n_chunks * tile_groups) return;
    const int tg = static_cast<int>(w % tile_groups);
    const long long rc = w / tile_groups;
    const int chunk = static_cast<int>(rc % n_chunks);
    const long long row = rc / n_chunks;
    const int e0 = chunk * WARP_CHUNK + lane * VEC;
    const bool mine = e0 < d;
    const int per_group = (n_tiles + tile_groups - 1) / tile_groups;
    const int t0 = tg * per_group, t1 = min(n_tiles, t0 + per_group);
    const __nv_bfloat16* wd = w_ud + d + e0;  // + j * 2d per neuron
    float acc[VEC] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int t = t0; t < t1; ++t) {
        const long long rt = row * n_tiles + t;
        const int count = static_cast<int>(counts[rt]);
        if (count <= cap) {
            const long long s0 = rt * cap;
            int s = 0;
            // Four neurons at a time: four independent 16-byte loads in flight.
            for (; s + 4 <= count; s += 4) {
                int j[4];
                float h[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    j[q] = t * tile + indices[s0 + s + q];
                    h[q] = __bfloat162float(values[s0 + s + q]);
                }
                if (mine) {
#pragma unroll
                    for (int q = 0; q < 4; ++q) axpy8(h[q], wd + static_cast<long long>(j[q]) * 2 * d, acc);
                }
            }
            for (; s < count; ++s) {
                const int j = t * tile + indices[s0 + s];
                const float h = __bfloat162float(values[s0 + s]);
                if (mine) axpy8(h, wd + static_cast<long long>(j) * 2 * d, acc);
            }
        } else {
            const int c0 = t * tile;
            each_dense_nonzero(gate + row * f + c0, min(tile, f - c0), [&](int c, float h) {
                if (mine) axpy8(h, wd + static_cast<long long>(c0 + c) * 2 * d, acc);
            });
        }
    }
    if (tile_groups == 1) {
        if (mine) store8(out + row * d + e0, acc);
        if (chunk == 0 && lane == 0) out[l1_at(M, d, row)] = __float2bfloat16(l1[row]);
    } else if (mine) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) red_add(acc_out + row * d + e0 + k, acc[k]);
    }
}

// Decode path epilogue: the f32 partial sums [M, d] to bf16, then the L1 terms.
extern "C" __global__ void gated_t2d_finish_bf16(const float* __restrict__ acc, const float* __restrict__ l1,
                                                 __nv_bfloat16* __restrict__ out, int M, int d) {
    const long long rows = static_cast<long long>(M) * d;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows + M;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        out[i] = __float2bfloat16(i < rows ? acc[i] : l1[i - rows]);
    }
}

// Prefill path, up: a token row per warp, or per SPLIT consecutive warps of a block,
// each taking a contiguous share of the row's tiles (`RowPart`): at a few thousand tokens
// one warp per row leaves the card short of loads in flight, and the kernel's time is
// that of its longest row. The row of x stays in registers (MAXV 16-byte vectors per
// lane, packed bf16); `walk_pairs` reads up to 32 of the row's slots at once, across
// tiles, and their h go back with one store each. The token's L1 term is stored, not
// added (the parts of a split row meet in shared memory first).
// NORM (inference, the norm before the MLP folded in): x is the residual sum s, not yet
// normalised, and the gate came from s with the norm's weight folded into the gate and up
// rows (`SparseMlp::fold_pre_norm`). The RMS norm's factor r = rsqrt(mean(s²) + eps) is
// positive, so relu(r · g) = r · relu(g): the pack kept the right neurons, and each h is
// r · g · u, with u the dot of the normalised row, made here in registers.
//
// MASK (inference, a warp a row): no TwELL slots; the row's pairs come from the gate
// GEMM's ReLU bit mask (`walk_mask_row`), each h is left in the gate row at its column
// (where the down kernel reads it), and the row's tile counts are written here, so the
// pack launch goes.
template <int MAXV, int SPLIT, bool NORM, bool MASK>
__device__ void up_row(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,
                       const uint32_t* __restrict__ counts, const uint8_t* __restrict__ indices,
                       __nv_bfloat16* __restrict__ values, __nv_bfloat16* __restrict__ gate,
                       float* __restrict__ l1_out, __nv_bfloat16* __restrict__ u_out, int M, int d, int f,
                       int tile, int cap, int n_tiles, float eps, const uint32_t* __restrict__ mask = nullptr,
                       int words_per_row = 0, uint32_t* __restrict__ counts_out = nullptr) {
    static_assert(!MASK || SPLIT == 1, "the mask walk takes whole rows");
    const RowPart rp(SPLIT, n_tiles);
    const long long row = rp.row;
    const int lane = threadIdx.x & 31;
    // A whole row per warp has no partner to wait for.
    if (SPLIT == 1 && row >= M) return;
    float l1 = 0.f;
    if (row < M) {
        uint4 xr[MAXV];
        row_to_registers<MAXV>(x + row * d, d, xr);
        const float g_scale = NORM ? normalize_registers<MAXV>(xr, d, eps) : 1.f;
        const long long two_d = 2LL * d;
        auto dot = [&](int j) { return registers_dot<MAXV>(xr, w_ud + j * two_d, d); };
        // Where a pair's h goes: its slot, or its column of the gate row (MASK).
        __nv_bfloat16* h_out = MASK ? gate + row * f : values;
        auto pairs = [&](int j, float g, long long slot, int n) {
            __nv_bfloat16 mine = __float2bfloat16(0.f), mine_u = mine;
            // One neuron at a time: interleaving two (twice the loads in flight) measured
            // slower, the extra registers costing more than they hid; so did asking L1 for
            // the next neuron's row.
            for (int q = 0; q < n; ++q) {
                const float u = dot(__shfl_sync(FULL_MASK, j, q));
                const __nv_bfloat16 h = __float2bfloat16(g_scale * __shfl_sync(FULL_MASK, g, q) * u);
                l1 += fabsf(__bfloat162float(h));
                if (lane == q) {
                    mine = h;
                    mine_u = __float2bfloat16(u);
                }
            }
            if (slot >= 0) {
                h_out[slot] = mine;
                if (u_out) u_out[slot] = mine_u;
            }
        };
        if constexpr (MASK) {
            walk_mask_row(mask + row * words_per_row, words_per_row, f, gate + row * f, counts_out + row * n_tiles,
                          tile >> 5, pairs);
        } else {
            walk_pairs(counts, indices, values, row, rp.t_begin, rp.t_end, tile, cap, n_tiles, f, pairs,
                       [&](int c0, int width) {
                           __nv_bfloat16* src = gate + row * f + c0;
                           for (int k = 0; k < width; k += 32) {
                               const int col = k + lane;
                               const float g = col < width ? __bfloat162float(src[col]) : 0.f;
                               uint32_t positive = __ballot_sync(FULL_MASK, g > 0.f);
                               __nv_bfloat16 mine = __float2bfloat16(0.f);  // non-positive gates become 0
                               while (positive) {
                                   const int q = __ffs(positive) - 1;
                                   positive &= positive - 1;
                                   const float u = dot(c0 + k + q);
                                   const __nv_bfloat16 h =
                                       __float2bfloat16(g_scale * __shfl_sync(FULL_MASK, g, q) * u);
                                   l1 += fabsf(__bfloat162float(h));
                                   if (lane == q) mine = h;
                               }
                               if (col < width) src[col] = mine;
                           }
                       });
        }
    }
    if (SPLIT == 1) {
        if (lane == 0) l1_out[row] = l1;
        return;
    }
    // The row's parts are warps wib .. wib + SPLIT - 1 of this block: part 0 sums them
    // in order, so the term does not depend on which part finished first.
    __shared__ float parts[ROW_BLOCK_WARPS];
    const int wib = threadIdx.x >> 5;
    if (lane == 0) parts[wib] = l1;
    __syncthreads();
    if (rp.part == 0 && row < M && lane == 0) {
        float sum = 0.f;
        for (int k = 0; k < SPLIT; ++k) sum += parts[wib + k];
        l1_out[row] = sum;
    }
}

// One entry point per row width and split (`gated_t2d_up_rows_bf16_v{MAXV}_s{SPLIT}`): the
// split is a constant, so the one-warp-per-row kernels carry none of the split's code.
// `gated_t2d_up_rows_norm_bf16_v{MAXV}_s{SPLIT}` is the NORM form, with the norm's eps.
#define UP_ROW_KERNEL(MAXV, SPLIT)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) gated_t2d_up_rows_bf16_v##MAXV##_s##SPLIT(     \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,                \
        const uint32_t* __restrict__ counts, const uint8_t* __restrict__ indices,                   \
        __nv_bfloat16* __restrict__ values, __nv_bfloat16* __restrict__ gate, float* __restrict__ l1, \
        __nv_bfloat16* __restrict__ u_out, int M, int d, int f, int tile, int cap, int n_tiles) {   \
        up_row<MAXV, SPLIT, false, false>(x, w_ud, counts, indices, values, gate, l1, u_out, M, d, f, tile, \
                                          cap, n_tiles, 0.f);                                       \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) gated_t2d_up_rows_norm_bf16_v##MAXV##_s##SPLIT( \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,                \
        const uint32_t* __restrict__ counts, const uint8_t* __restrict__ indices,                   \
        __nv_bfloat16* __restrict__ values, __nv_bfloat16* __restrict__ gate, float* __restrict__ l1, \
        __nv_bfloat16* __restrict__ u_out, int M, int d, int f, int tile, int cap, int n_tiles,     \
        float eps) {                                                                                \
        up_row<MAXV, SPLIT, true, false>(x, w_ud, counts, indices, values, gate, l1, u_out, M, d, f, tile, \
                                         cap, n_tiles, eps);                                        \
    }
#define UP_ROW_KERNELS(MAXV) \
    UP_ROW_KERNEL(MAXV, 1) UP_ROW_KERNEL(MAXV, 2) UP_ROW_KERNEL(MAXV, 4) UP_ROW_KERNEL(MAXV, 8)
UP_ROW_KERNELS(1)
UP_ROW_KERNELS(2)
UP_ROW_KERNELS(4)
UP_ROW_KERNELS(8)
UP_ROW_KERNELS(16)

// The MASK forms, a warp a row (`gated_t2d_up_mask_rows[_norm]_bf16_v{MAXV}`): the row's
// pairs from the gate's ReLU bit mask `[M, words_per_row]`, h left in `gate`, the tile
// counts written to `counts`.
#define UP_MASK_ROW_KERNEL(MAXV)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, MAXV >= 16 ? 1 : 2) gated_t2d_up_mask_rows_bf16_v##MAXV(           \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,                \
        const uint32_t* __restrict__ mask, uint32_t* __restrict__ counts, __nv_bfloat16* __restrict__ gate, \
        float* __restrict__ l1, int M, int d, int f, int tile, int n_tiles, int words_per_row) {     \
        up_row<MAXV, 1, false, true>(x, w_ud, nullptr, nullptr, nullptr, gate, l1, nullptr, M, d, f, tile, 0, \
                                     n_tiles, 0.f, mask, words_per_row, counts);                    \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256, MAXV >= 16 ? 1 : 2) gated_t2d_up_mask_rows_norm_bf16_v##MAXV(      \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,                \
        const uint32_t* __restrict__ mask, uint32_t* __restrict__ counts, __nv_bfloat16* __restrict__ gate, \
        float* __restrict__ l1, int M, int d, int f, int tile, int n_tiles, int words_per_row, float eps) { \
        up_row<MAXV, 1, true, true>(x, w_ud, nullptr, nullptr, nullptr, gate, l1, nullptr, M, d, f, tile, 0, \
                                    n_tiles, eps, mask, words_per_row, counts);                     \
    }
UP_MASK_ROW_KERNEL(1)
UP_MASK_ROW_KERNEL(2)
UP_MASK_ROW_KERNEL(4)
UP_MASK_ROW_KERNEL(8)
UP_MASK_ROW_KERNEL(16)

// Prefill path, down: a token row per warp, or per SPLIT consecutive warps of a block
// (`RowPart`, as in up), the output row (or this part's share of it) in registers (MAXV
// 16-byte vectors per lane). `walk_pairs` reads up to 32 of the row's (j, h) at once,
// across tiles, and broadcasts them; every neuron then costs MAXV independent 16-byte
// loads per lane (its whole Wd row), with no reduction between them. The parts of a
// split row meet in dynamic shared memory (parts 1.. leave their f32 sums there, part 0
// adds them in order: deterministic). Stores the bf16 row and the token's L1 term.
// The folded norm's two outputs at columns e..e+7 of `row`: the sum s into out's first M
// rows and its normalised s · scale · alpha into the next M.
__device__ __forceinline__ void store_sum_and_normed8(__nv_bfloat16* __restrict__ out, int M, long long row, int d,
                                                      int e, const float* s, float scale,
                                                      const __nv_bfloat16* __restrict__ alpha) {
    store8(out + row * d + e, s);
    float a[VEC], o[VEC];
    load8(alpha + e, a);
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] = scale * s[k] * a[k];
    store8(out + (M + row) * d + e, o);
}

// FOLD (inference): the residual add and RMS norm after the MLP run on the row while it is
// in registers, as `add_rms_norm` does them (the output rounded to bf16, s = bf16(residual
// + it), s · rsqrt(mean(s²) + eps) · alpha), and `out` is [2M, d]: the sums, then the
// normalised rows; no L1 term. Only the sum of squares is reduced in another order (a
// warp's, not a block's).
// MASK (a warp a row): the row's pairs from the gate's ReLU bit mask, each h read from its
// column of the gate row, where the MASK up kernel left it.
template <int MAXV, int SPLIT, bool FOLD, bool MASK>
__device__ void down_row(const __nv_bfloat16* __restrict__ w_ud, const uint32_t* __restrict__ counts,
                         const uint8_t* __restrict__ indices, const __nv_bfloat16* __restrict__ values,
                         const __nv_bfloat16* __restrict__ gate, const float* __restrict__ l1,
                         __nv_bfloat16* __restrict__ out, int M, int d, int f, int tile, int cap, int n_tiles,
                         const __nv_bfloat16* __restrict__ residual, const __nv_bfloat16* __restrict__ alpha,
                         float eps, const uint32_t* __restrict__ mask = nullptr, int words_per_row = 0) {
    static_assert(!MASK || SPLIT == 1, "the mask walk takes whole rows");
    const RowPart rp(SPLIT, n_tiles);
    const long long row = rp.row;
    const int lane = threadIdx.x & 31;
    const long long two_d = 2LL * d;
    float acc[MAXV][VEC];
#pragma unroll
    for (int i = 0; i < MAXV; ++i)
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[i][k] = 0.f;
    auto add = [&](int j, float h) {
        const __nv_bfloat16* wd = w_ud + j * two_d + d;
#pragma unroll
        for (int i = 0; i < MAXV; ++i) {
            const int e = (lane + 32 * i) * VEC;
            if (e < d) axpy8(h, wd + e, acc[i]);
        }
    };
    if (row < M) {
        auto pairs = [&](int j, float h, long long, int n) {
            for (int q = 0; q < n; ++q) add(__shfl_sync(FULL_MASK, j, q), __shfl_sync(FULL_MASK, h, q));
        };
        if constexpr (MASK) {
            walk_mask_row(mask + row * words_per_row, words_per_row, f, gate + row * f, nullptr, tile >> 5, pairs);
        } else {
            walk_pairs(counts, indices, values, row, rp.t_begin, rp.t_end, tile, cap, n_tiles, f, pairs,
                       [&](int c0, int width) {
                           each_dense_nonzero(gate + row * f + c0, width, [&](int c, float h) { add(c0 + c, h); });
                       });
        }
    }
    if (SPLIT > 1) {
        // Slot of part p >= 1 of the block's r-th row: r * (SPLIT - 1) + p - 1, d floats each.
        extern __shared__ float row_parts[];
        const int r = (threadIdx.x >> 5) / SPLIT;
        auto slot = [&](int p) { return row_parts + static_cast<long long>(r * (SPLIT - 1) + p - 1) * d; };
        if (rp.part > 0) {
            float* mine = slot(rp.part);
#pragma unroll
            for (int i = 0; i < MAXV; ++i) {
                const int e = (lane + 32 * i) * VEC;
                if (e < d) {
                    float4* m4 = reinterpret_cast<float4*>(mine + e);
                    m4[0] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
                    m4[1] = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
                }
            }
        }
        __syncthreads();
        if (rp.part > 0) return;
        for (int p = 1; p < SPLIT; ++p) {
            const float* theirs = slot(p);
#pragma unroll
            for (int i = 0; i < MAXV; ++i) {
                const int e = (lane + 32 * i) * VEC;
                if (e < d) {
                    const float4* t4 = reinterpret_cast<const float4*>(theirs + e);
                    const float4 lo = t4[0], hi = t4[1];
                    acc[i][0] += lo.x, acc[i][1] += lo.y, acc[i][2] += lo.z, acc[i][3] += lo.w;
                    acc[i][4] += hi.x, acc[i][5] += hi.y, acc[i][6] += hi.z, acc[i][7] += hi.w;
                }
            }
        }
    }
    if (row >= M) return;
    if constexpr (FOLD) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < MAXV; ++i) {
            const int e = (lane + 32 * i) * VEC;
            if (e < d) {
                float r[VEC];
                load8(residual + row * d + e, r);
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    acc[i][k] = round_bf16(r[k] + round_bf16(acc[i][k]));
                    ss = fmaf(acc[i][k], acc[i][k], ss);
                }
            }
        }
        const float scale = rsqrtf(warp_sum(ss) / d + eps);
#pragma unroll
        for (int i = 0; i < MAXV; ++i) {
            const int e = (lane + 32 * i) * VEC;
            if (e < d) store_sum_and_normed8(out, M, row, d, e, acc[i], scale, alpha);
        }
    } else {
#pragma unroll
        for (int i = 0; i < MAXV; ++i) {
            const int e = (lane + 32 * i) * VEC;
            if (e < d) store8(out + row * d + e, acc[i]);
        }
        if (lane == 0) out[l1_at(M, d, row)] = __float2bfloat16(l1[row]);
    }
}

#define DOWN_ROW_KERNEL(MAXV, SPLIT)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) gated_t2d_down_rows_bf16_v##MAXV##_s##SPLIT(        \
        const __nv_bfloat16* __restrict__ w_ud, const uint32_t* __restrict__ counts,                     \
        const uint8_t* __restrict__ indices, const __nv_bfloat16* __restrict__ values,                   \
        const __nv_bfloat16* __restrict__ gate, const float* __restrict__ l1,                            \
        __nv_bfloat16* __restrict__ out, int M, int d, int f, int tile, int cap, int n_tiles) {          \
        down_row<MAXV, SPLIT, false, false>(w_ud, counts, indices, values, gate, l1, out, M, d, f, tile, cap, \
                                     n_tiles, nullptr, nullptr, 0.f);                                     \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) gated_t2d_down_rows_norm_bf16_v##MAXV##_s##SPLIT(   \
        const __nv_bfloat16* __restrict__ w_ud, const uint32_t* __restrict__ counts,                     \
        const uint8_t* __restrict__ indices, const __nv_bfloat16* __restrict__ values,                   \
        const __nv_bfloat16* __restrict__ gate, const float* __restrict__ l1,                            \
        __nv_bfloat16* __restrict__ out, int M, int d, int f, int tile, int cap, int n_tiles,            \
        const __nv_bfloat16* __restrict__ residual, const __nv_bfloat16* __restrict__ alpha, float eps) { \
        down_row<MAXV, SPLIT, true, false>(w_ud, counts, indices, values, gate, l1, out, M, d, f, tile, cap, \
                                    n_tiles, residual, alpha, eps);                                       \
    }
#define DOWN_ROW_KERNELS(MAXV) \
    DOWN_ROW_KERNEL(MAXV, 1) DOWN_ROW_KERNEL(MAXV, 2) DOWN_ROW_KERNEL(MAXV, 4) DOWN_ROW_KERNEL(MAXV, 8)
DOWN_ROW_KERNELS(1)
DOWN_ROW_KERNELS(2)
DOWN_ROW_KERNELS(4)
DOWN_ROW_KERNELS(8)
DOWN_ROW_KERNELS(16)

// The MASK forms, a warp a row (`gated_t2d_down_mask_rows[_norm]_bf16_v{MAXV}`), after the
// MASK up kernel.
#define DOWN_MASK_ROW_KERNEL(MAXV)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, MAXV >= 16 ? 1 : 2) gated_t2d_down_mask_rows_bf16_v##MAXV(              \
        const __nv_bfloat16* __restrict__ w_ud, const uint32_t* __restrict__ mask,                       \
        const __nv_bfloat16* __restrict__ gate, const float* __restrict__ l1, __nv_bfloat16* __restrict__ out, \
        int M, int d, int f, int tile, int n_tiles, int words_per_row) {                                 \
        down_row<MAXV, 1, false, true>(w_ud, nullptr, nullptr, nullptr, gate, l1, out, M, d, f, tile, 0, n_tiles, \
                                       nullptr, nullptr, 0.f, mask, words_per_row);                      \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, MAXV >= 16 ? 1 : 2) gated_t2d_down_mask_rows_norm_bf16_v##MAXV(         \
        const __nv_bfloat16* __restrict__ w_ud, const uint32_t* __restrict__ mask,                       \
        const __nv_bfloat16* __restrict__ gate, const float* __restrict__ l1, __nv_bfloat16* __restrict__ out, \
        int M, int d, int f, int tile, int n_tiles, int words_per_row,                                   \
        const __nv_bfloat16* __restrict__ residual, const __nv_bfloat16* __restrict__ alpha, float eps) { \
        down_row<MAXV, 1, true, true>(w_ud, nullptr, nullptr, nullptr, gate, l1, out, M, d, f, tile, 0, n_tiles, \
                                      residual, alpha, eps, mask, words_per_row);                        \
    }
DOWN_MASK_ROW_KERNEL(1)
DOWN_MASK_ROW_KERNEL(2)
DOWN_MASK_ROW_KERNEL(4)
DOWN_MASK_ROW_KERNEL(8)
DOWN_MASK_ROW_KERNEL(16)

// ---------------------------------------------------------------------------------------
// 2 to 64 rows at inference, spread over the card (`StagedRows::SpreadKernels`).
//
// A block a row (the row kernels at decode sizes) keeps 16 of an H100's 132
// multiprocessors busy at 16 rows, and each of its warps waits on its neurons one after
// another. Here up gives a warp each chunk of 32 · NPL neurons of a row, and down a block
// each 256-column slice of a row, its eight warps splitting the row's neurons: at 16 rows
// of hidden 2048 / d_ff 5632, thousands of warps in the first and 128 blocks in the second.
//
// up: h[r, j] = bf16(g_rj · (x_r · Wu_j)) for every positive g_rj, and 0 elsewhere: every
//     element of h [M, f] is written, so nothing is zeroed first. An active h that rounds
//     to zero is stored as -0 (bits 0x8000), so down tells active neurons by nonzero bits.
// down: out_r[slice] = Σ_j h_rj · Wd_j[slice] over the active neurons, each warp adding its
//     neurons in column order and the warps meeting in shared memory in warp order, so
//     the sums do not depend on timing. The blocks of slice 0 also write each row's L1 term
//     Σ|h_rj| (same fixed order) and its tile counts.

#define SPREAD_WARPS 8
// Neurons a down warp lists before it reads their Wd slices: one 256-neuron chunk at most.
#define SPREAD_LIST WARP_CHUNK
// Wd slices a down lane has in flight at once.
#define SPREAD_LOADS 8

// bf16 k (0-7, the same in every lane) of a 16-byte vector, and the same with value v.
__device__ __forceinline__ uint32_t bf16_bits_at(const uint4& v, int k) {
    const uint32_t w = k < 4 ? (k < 2 ? v.x : v.y) : (k < 6 ? v.z : v.w);
    return (k & 1) ? (w >> 16) : (w & 0xffffu);
}
__device__ __forceinline__ void set_bf16_bits_at(uint4& v, int k, uint32_t bits) {
    // By selects, not a reference to the word: a word picked at run time goes to local memory.
    const int word = k >> 1, shift = (k & 1) * 16;
    const uint32_t keep = ~(0xffffu << shift), put = bits << shift;
    v.x = word == 0 ? (v.x & keep) | put : v.x;
    v.y = word == 1 ? (v.y & keep) | put : v.y;
    v.z = word == 2 ? (v.z & keep) | put : v.z;
    v.w = word == 3 ? (v.w & keep) | put : v.w;
}
__device__ __forceinline__ float bf16_bits_float(uint32_t bits) {
    return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(bits)));
}

// NPL (1, 2, 4 or 8) consecutive bf16 of lane `lane` at p (NPL-aligned), as the low NPL
// values of a 16-byte vector (zeros above), and back.
template <int NPL>
__device__ __forceinline__ uint4 load_npl(const __nv_bfloat16* p) {
    if constexpr (NPL == 8) return __ldg(reinterpret_cast<const uint4*>(p));
    if constexpr (NPL == 4) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        return make_uint4(v.x, v.y, 0u, 0u);
    }
    if constexpr (NPL == 2) return make_uint4(__ldg(reinterpret_cast<const unsigned int*>(p)), 0u, 0u, 0u);
    return make_uint4(__ldg(reinterpret_cast<const unsigned short*>(p)), 0u, 0u, 0u);
}
template <int NPL>
__device__ __forceinline__ void store_npl(__nv_bfloat16* p, const uint4& v) {
    if constexpr (NPL == 8) *reinterpret_cast<uint4*>(p) = v;
    if constexpr (NPL == 4) *reinterpret_cast<uint2*>(p) = make_uint2(v.x, v.y);
    if constexpr (NPL == 2) *reinterpret_cast<unsigned int*>(p) = v.x;
    if constexpr (NPL == 1) *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(v.x);
}

// Grid (ceil(f / (32 · NPL · SPREAD_WARPS)), M), SPREAD_WARPS warps a block. NORM: x is
// the residual sum and the row is normalised in registers, as in `up_row`.
template <int MAXV, int NPL, bool NORM>
__device__ void up_spread(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,
                          const __nv_bfloat16* __restrict__ gate, __nv_bfloat16* __restrict__ h, int d, int f,
                          float eps) {
    const int lane = threadIdx.x & 31;
    const long long row = blockIdx.y;
    const int c0 = (blockIdx.x * SPREAD_WARPS + (threadIdx.x >> 5)) * 32 * NPL;
    if (c0 >= f) return;
    const int j0 = c0 + lane * NPL;  // f % 8 == 0: a lane's NPL neurons lie all below f or all past it
    const uint4 g = j0 < f ? load_npl<NPL>(gate + row * f + j0) : make_uint4(0u, 0u, 0u, 0u);
    // The row's loads go out with the gate's: most warps find a positive at the sizes
    // this form is picked for, and then need the row at once.
    uint4 xr[MAXV];
    row_to_registers<MAXV>(x + row * d, d, xr);
    const float g_scale = NORM ? normalize_registers<MAXV>(xr, d, eps) : 1.f;
    uint32_t positive = 0;
#pragma unroll
    for (int k = 0; k < NPL; ++k) {
        const uint32_t b = bf16_bits_at(g, k);
        // Positive: sign clear and not zero (NaN gates are never positive, as `g > 0`).
        if (bf16_bits_float(b) > 0.f) positive |= 1u << k;
    }
    uint4 out = make_uint4(0u, 0u, 0u, 0u);
    const long long two_d = 2LL * d;
    uint32_t lanes = __ballot_sync(FULL_MASK, positive != 0);
    while (lanes) {
        const int q = __ffs(lanes) - 1;
        lanes &= lanes - 1;
        uint32_t bits = __shfl_sync(FULL_MASK, positive, q);
        while (bits) {
            const int k = __ffs(bits) - 1;
            bits &= bits - 1;
            const int j = c0 + q * NPL + k;
            const float u = registers_dot<MAXV>(xr, w_ud + j * two_d, d);
            const float gk = bf16_bits_float(__shfl_sync(FULL_MASK, bf16_bits_at(g, k), q));
            uint32_t hb = __bfloat16_as_ushort(__float2bfloat16(g_scale * gk * u));
            if ((hb & 0x7fffu) == 0u) hb = 0x8000u;  // active, and zero: -0
            if (lane == q) set_bf16_bits_at(out, k, hb);
        }
    }
    if (j0 < f) store_npl<NPL>(h + row * f + j0, out);
}

#define UP_SPREAD_KERNEL(MAXV, NPL)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) gated_t2d_up_spread_bf16_v##MAXV##_n##NPL(      \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,                 \
        const __nv_bfloat16* __restrict__ gate, __nv_bfloat16* __restrict__ h, int d, int f) {       \
        up_spread<MAXV, NPL, false>(x, w_ud, gate, h, d, f, 0.f);                                    \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) gated_t2d_up_spread_norm_bf16_v##MAXV##_n##NPL( \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,                 \
        const __nv_bfloat16* __restrict__ gate, __nv_bfloat16* __restrict__ h, int d, int f,         \
        float eps) {                                                                                 \
        up_spread<MAXV, NPL, true>(x, w_ud, gate, h, d, f, eps);                                     \
    }
#define UP_SPREAD_KERNELS(MAXV) \
    UP_SPREAD_KERNEL(MAXV, 1) UP_SPREAD_KERNEL(MAXV, 2) UP_SPREAD_KERNEL(MAXV, 4) UP_SPREAD_KERNEL(MAXV, 8)
UP_SPREAD_KERNELS(1)
UP_SPREAD_KERNELS(2)
UP_SPREAD_KERNELS(4)
UP_SPREAD_KERNELS(8)
UP_SPREAD_KERNELS(16)

// Most 16-byte vectors a thread holds in the folded epilogue: hidden up to 4096 over 256
// threads.
#define SPREAD_NORM_VECS 2

// Grid (ceil(d / 256), M), SPREAD_WARPS warps a block; `out` is [M, d] rows then M L1
// terms, `counts` [M, n_tiles] (tiles of 32-256 neurons, so a tile's lanes share a warp).
// FOLD (hidden up to 4096): the residual add and RMS norm after the MLP, as `down_row`'s
// FOLD does them, and `out` is [2M, d], the sums then the normalised rows, with no L1
// term. The slices of a row leave their bf16 output in `staging` [M, d]; the last of them
// to finish (a ticket per row after a fence; it zeroes the ticket again) adds the
// residual and normalises the whole row.
template <bool FOLD>
__device__ void down_spread(const __nv_bfloat16* __restrict__ w_ud, const __nv_bfloat16* __restrict__ h,
                            uint32_t* __restrict__ counts, __nv_bfloat16* __restrict__ out, int M, int d, int f,
                            int tile, int n_tiles, const __nv_bfloat16* __restrict__ residual,
                            const __nv_bfloat16* __restrict__ alpha, float eps, __nv_bfloat16* staging,
                            uint32_t* tickets) {
    __shared__ int list_j[SPREAD_WARPS][SPREAD_LIST];
    __shared__ float list_h[SPREAD_WARPS][SPREAD_LIST];
    __shared__ __align__(16) float sums[SPREAD_WARPS][WARP_CHUNK];
    __shared__ float l1s[SPREAD_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long row = blockIdx.y;
    const bool first_slice = blockIdx.x == 0;
    const int e = blockIdx.x * WARP_CHUNK + lane * VEC;  // this lane's 8 columns
    const long long two_d = 2LL * d;
    const __nv_bfloat16* wd = w_ud + d + (e < d ? e : 0);
    const __nv_bfloat16* hr = h + row * f;
    float acc[VEC] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float l1 = 0.f;
    int listed = 0;
    // Reads the listed neurons' Wd slices, SPREAD_LOADS at a time, into the sums.
    auto flush = [&]() {
        for (int p = 0; p < listed; p += SPREAD_LOADS) {
            uint4 w[SPREAD_LOADS];
            float hv[SPREAD_LOADS];
#pragma unroll
            for (int q = 0; q < SPREAD_LOADS; ++q) {
                const bool in = p + q < listed;
                hv[q] = in ? list_h[warp][p + q] : 0.f;
                w[q] = in && e < d ? __ldg(reinterpret_cast<const uint4*>(wd + list_j[warp][p + q] * two_d))
                                   : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int q = 0; q < SPREAD_LOADS; ++q) {
                const __nv_bfloat162* wh = reinterpret_cast<const __nv_bfloat162*>(&w[q]);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float2 wf = __bfloat1622float2(wh[k]);
                    acc[2 * k] = fmaf(hv[q], wf.x, acc[2 * k]);
                    acc[2 * k + 1] = fmaf(hv[q], wf.y, acc[2 * k + 1]);
                }
            }
        }
        __syncwarp();
        listed = 0;
    };
    // The warp's chunks of 256 neurons: warp, warp + 8, ...; the next chunk's load is on its
    // way while this one is listed.
    const int stride = SPREAD_WARPS * WARP_CHUNK;
    int c0 = warp * WARP_CHUNK;
    uint4 next = c0 + lane * VEC < f ? __ldg(reinterpret_cast<const uint4*>(hr + c0 + lane * VEC))
                                     : make_uint4(0u, 0u, 0u, 0u);
    for (; c0 < f; c0 += stride) {
        const uint4 cur = next;
        const int jn = c0 + stride + lane * VEC;
        next = jn < f ? __ldg(reinterpret_cast<const uint4*>(hr + jn)) : make_uint4(0u, 0u, 0u, 0u);
        uint32_t active = 0;
#pragma unroll
        for (int k = 0; k < VEC; ++k)
            if (bf16_bits_at(cur, k) != 0u) active |= 1u << k;
        const int n = __popc(active);
        if (first_slice && counts != nullptr) {
            // A tile's tile / 8 lanes add their counts; its first lane writes them.
            const int tile_lanes = tile / VEC;
            int c = n;
            for (int o = 1; o < tile_lanes; o <<= 1) c += __shfl_xor_sync(FULL_MASK, c, o);
            const int j0 = c0 + lane * VEC;
            if (lane % tile_lanes == 0 && j0 < f) counts[row * n_tiles + j0 / tile] = c;
        }
        const int incl = warp_inclusive_sum(n);
        const int total = __shfl_sync(FULL_MASK, incl, 31);
        if (listed + total > SPREAD_LIST) flush();
        int at = listed + incl - n;
        for (int k = 0; k < VEC; ++k) {
            if (!(active >> k & 1u)) continue;
            const float v = bf16_bits_float(bf16_bits_at(cur, k));
            l1 += fabsf(v);
            list_j[warp][at] = c0 + lane * VEC + k;
            list_h[warp][at] = v;
            ++at;
        }
        listed += total;
        __syncwarp();
    }
    flush();
    l1 = warp_sum(l1);
    if (e < d) {
        float4* mine = reinterpret_cast<float4*>(&sums[warp][lane * VEC]);
        mine[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        mine[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    if (lane == 0) l1s[warp] = l1;
    __syncthreads();
    if (warp == 0 && e < d) {
        float total[VEC] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int w = 0; w < SPREAD_WARPS; ++w) {
            const float4* theirs = reinterpret_cast<const float4*>(&sums[w][lane * VEC]);
            const float4 lo = theirs[0], hi = theirs[1];
            total[0] += lo.x, total[1] += lo.y, total[2] += lo.z, total[3] += lo.w;
            total[4] += hi.x, total[5] += hi.y, total[6] += hi.z, total[7] += hi.w;
        }
        store8((FOLD ? staging : out) + row * d + e, total);
    }
    if constexpr (!FOLD) {
        if (warp == 0 && first_slice && lane == 0) {
            float sum = 0.f;
            for (int w = 0; w < SPREAD_WARPS; ++w) sum += l1s[w];
            out[l1_at(M, d, row)] = __float2bfloat16(sum);
        }
        return;
    }
    __shared__ bool last;
    __shared__ float squares[SPREAD_WARPS];
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(tickets + row, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The whole row, SPREAD_NORM_VECS vectors a thread: s = bf16(residual + mlp), then
    // s · rsqrt(mean(s²) + eps) · alpha.
    float sum[SPREAD_NORM_VECS][VEC];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < SPREAD_NORM_VECS; ++i) {
        const int c = (threadIdx.x + i * SPREAD_WARPS * 32) * VEC;
        if (c < d) {
            const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(staging + row * d + c));
            const __nv_bfloat162* mh = reinterpret_cast<const __nv_bfloat162*>(&raw);
            float r[VEC];
            load8(residual + row * d + c, r);
#pragma unroll
            for (int q = 0; q < VEC / 2; ++q) {
                const float2 mf = __bfloat1622float2(mh[q]);
                sum[i][2 * q] = round_bf16(r[2 * q] + mf.x);
                sum[i][2 * q + 1] = round_bf16(r[2 * q + 1] + mf.y);
            }
#pragma unroll
            for (int k = 0; k < VEC; ++k) ss = fmaf(sum[i][k], sum[i][k], ss);
        }
    }
    ss = warp_sum(ss);
    if (lane == 0) squares[warp] = ss;
    __syncthreads();
    float total_ss = 0.f;
    for (int w = 0; w < SPREAD_WARPS; ++w) total_ss += squares[w];
    const float scale = rsqrtf(total_ss / d + eps);
#pragma unroll
    for (int i = 0; i < SPREAD_NORM_VECS; ++i) {
        const int c = (threadIdx.x + i * SPREAD_WARPS * 32) * VEC;
        if (c < d) store_sum_and_normed8(out, M, row, d, c, sum[i], scale, alpha);
    }
    if (threadIdx.x == 0) tickets[row] = 0u;
}

extern "C" __global__ void __launch_bounds__(256) gated_t2d_down_spread_bf16(
    const __nv_bfloat16* __restrict__ w_ud, const __nv_bfloat16* __restrict__ h, uint32_t* __restrict__ counts,
    __nv_bfloat16* __restrict__ out, int M, int d, int f, int tile, int n_tiles) {
    down_spread<false>(w_ud, h, counts, out, M, d, f, tile, n_tiles, nullptr, nullptr, 0.f, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(256) gated_t2d_down_spread_norm_bf16(
    const __nv_bfloat16* __restrict__ w_ud, const __nv_bfloat16* __restrict__ h, uint32_t* __restrict__ counts,
    __nv_bfloat16* __restrict__ out, int M, int d, int f, int tile, int n_tiles,
    const __nv_bfloat16* __restrict__ residual, const __nv_bfloat16* __restrict__ alpha, float eps,
    __nv_bfloat16* staging, uint32_t* tickets) {
    down_spread<true>(w_ud, h, counts, out, M, d, f, tile, n_tiles, residual, alpha, eps, staging, tickets);
}

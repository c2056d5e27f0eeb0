// twell_mlp_bwd: the backward pass of the TwELL ReGLU MLP, per token row.
//
// With h_j = relu(g_j) * u_j, out = sum_j h_j Wd_j and l1 = sum_j |h_j|, for each
// active neuron j of a token (the forward's pattern):
//
//   dh_j = dout . Wd_j + dl * sign(h_j)
//   dg_j = dh_j * u_j          du_j = dh_j * g_j
//   dx   = sum_j dg_j Wg_j + du_j Wu_j
//
// Two kernels, one warp per token row each, so nothing is spent on inactive neurons:
// * `grads`: dout's row in registers, one contiguous read of Wd_j per active neuron;
//   writes dg and du of listed slots in slot layout. g and u of listed slots come from
//   the forward pass; overflowing tiles recompute both (rare) and write their whole
//   tile of h, dg and du into dense [M, f] matrices (zeros where inactive). With
//   `dense_all` every pair goes to those (zeroed) matrices too, for the cuBLAS weight
//   gradients (dWg = dGᵀ x, dWu = dUᵀ x, dWd = Hᵀ dout).
// The weight gradients' sparse path (`wgrad_*`, below) regroups the pairs by neuron.
// * `dx`: dx's row accumulated in registers, reads of Wg_j and Wu_j per active neuron;
//   dg and du come from the slot arrays (one coalesced load per tile, where reading
//   them from the dense matrices scattered a load per slot).
// One fused kernel needed both rows in registers (200+ per thread) and ran at a third
// of the speed for lack of warps in flight.
#include "common.cuh"

template <int MAXV>
__device__ void grads_row(const __nv_bfloat16* __restrict__ x,       // [M, d]
                          const __nv_bfloat16* __restrict__ dres,    // [M, d] rows, then M L1 terms
                          const __nv_bfloat16* __restrict__ wg,      // [f, d]
                          const __nv_bfloat16* __restrict__ w_ud,    // [f, 2d]
                          const uint32_t* __restrict__ counts,       // [M, n_tiles]
                          const uint8_t* __restrict__ indices,       // [M, n_tiles, cap]
                          const __nv_bfloat16* __restrict__ g_slots, // [M, n_tiles, cap]
                          const __nv_bfloat16* __restrict__ u_slots, // [M, n_tiles, cap]
                          __nv_bfloat16* __restrict__ h_out,         // [M, f], zeroed
                          __nv_bfloat16* __restrict__ dg_out,        // [M, f], zeroed
                          __nv_bfloat16* __restrict__ du_out,        // [M, f], zeroed
                          __nv_bfloat16* __restrict__ dg_slots,      // [M, n_tiles, cap]
                          __nv_bfloat16* __restrict__ du_slots,      // [M, n_tiles, cap]
                          int dense_all, int M, int d, int f, int tile, int cap, int n_tiles) {
    const long long row = global_warp();
    const int lane = threadIdx.x & 31;
    if (row >= M) return;
    const long long two_d = 2LL * d;
    uint4 dr[MAXV];
    row_to_registers<MAXV>(dres + row * d, d, dr);
    const float dl = __bfloat162float(dres[l1_at(M, d, row)]);

    // dout . Wd_j, in every lane.
    auto dot_dout = [&](int j) { return registers_dot<MAXV>(dr, w_ud + j * two_d + d, d); };
    const long long base = row * f;
    // The gradients of active neuron j from its g, u and dout . Wd_j: (dg, du), and
    // into the dense matrices when `dense`.
    auto store = [&](int j, float g, float u, float dd, bool dense) {
        const float h = g * u;
        const float sign = (h > 0.f) - (h < 0.f);
        const float dh = dd + dl * sign;
        const __nv_bfloat16 dg = __float2bfloat16(dh * u), du = __float2bfloat16(dh * g);
        if (dense) {
            h_out[base + j] = __float2bfloat16(h);
            dg_out[base + j] = dg;
            du_out[base + j] = du;
        }
        return __halves2bfloat162(dg, du);
    };

    walk_row(
        counts, indices, g_slots, row, tile, cap, n_tiles, f,
        [&](int j, float g, long long slot, int n) {
            const float u = slot >= 0 ? __bfloat162float(u_slots[slot]) : 0.f;
            float mine = 0.f;
            for (int q = 0; q < n; ++q) {
                const float dd = dot_dout(__shfl_sync(FULL_MASK, j, q));
                if (lane == q) mine = dd;
            }
            if (slot >= 0) {
                const __nv_bfloat162 both = store(j, g, u, mine, dense_all != 0);
                dg_slots[slot] = both.x;
                du_slots[slot] = both.y;
            }
        },
        [&](int c0, int width) {
            // The forward kept no g or u for this tile: recompute them. A neuron is
            // active where its gate, rounded to bf16 as the forward's was, is > 0.
            const __nv_bfloat16* xr = x + row * d;
            for (int k = 0; k < width; k += 32) {
                const int col = k + lane;
                float g = 0.f, u = 0.f, dd = 0.f;
                for (int q = 0; q < 32 && k + q < width; ++q) {
                    const float gq = warp_dot(xr, wg + static_cast<long long>(c0 + k + q) * d, d);
                    if (lane == q) g = round_bf16(gq);
                }
                uint32_t mask = __ballot_sync(FULL_MASK, col < width && g > 0.f);
                while (mask) {
                    const int q = __ffs(mask) - 1;
                    mask &= mask - 1;
                    const int j = c0 + k + q;
                    const float uq = warp_dot(xr, w_ud + j * two_d, d);
                    const float ddq = dot_dout(j);
                    if (lane == q) {
                        u = uq;
                        dd = ddq;
                    }
                }
                if (col < width && g > 0.f) {
                    store(c0 + col, g, u, dd, true);
                } else if (col < width) {
                    // Without `dense_all` the matrices are not zeroed: the tile's
                    // readers (`dx`, the sparse weight gradients) need its zeros.
                    const __nv_bfloat16 zero = __float2bfloat16(0.f);
                    h_out[base + c0 + col] = zero;
                    dg_out[base + c0 + col] = zero;
                    du_out[base + c0 + col] = zero;
                }
            }
        });
}

template <int MAXV>
__device__ void dx_row(const __nv_bfloat16* __restrict__ wg,      // [f, d]
                       const __nv_bfloat16* __restrict__ w_ud,    // [f, 2d]
                       const uint32_t* __restrict__ counts,       // [M, n_tiles]
                       const uint8_t* __restrict__ indices,       // [M, n_tiles, cap]
                       const __nv_bfloat16* __restrict__ dg_slots, // [M, n_tiles, cap]
                       const __nv_bfloat16* __restrict__ du_slots, // [M, n_tiles, cap]
                       const __nv_bfloat16* __restrict__ dg,      // [M, f]: for overflow tiles
                       const __nv_bfloat16* __restrict__ du,      // [M, f]: for overflow tiles
                       __nv_bfloat16* __restrict__ dx_out,        // [M, d]
                       int M, int d, int f, int tile, int cap, int n_tiles) {
    const long long row = global_warp();
    const int lane = threadIdx.x & 31;
    if (row >= M) return;
    const long long two_d = 2LL * d;
    const long long base = row * f;
    float acc[MAXV][VEC];
#pragma unroll
    for (int i = 0; i < MAXV; ++i)
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[i][k] = 0.f;
    // dx += a Wg_j + b Wu_j.
    auto add = [&](int j, float a, float b) {
        const __nv_bfloat16* g_row = wg + static_cast<long long>(j) * d;
        const __nv_bfloat16* u_row = w_ud + j * two_d;
#pragma unroll
        for (int i = 0; i < MAXV; ++i) {
            const int e = (lane + 32 * i) * VEC;
            if (e < d) {
                float wa[VEC], wb[VEC];
                load8(g_row + e, wa);
                load8(u_row + e, wb);
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[i][k] = fmaf(a, wa[k], fmaf(b, wb[k], acc[i][k]));
            }
        }
    };
    walk_row(
        counts, indices, dg_slots, row, tile, cap, n_tiles, f,
        [&](int j, float a, long long slot, int n) {
            const float b = slot >= 0 ? __bfloat162float(du_slots[slot]) : 0.f;
            for (int q = 0; q < n; ++q)
                add(__shfl_sync(FULL_MASK, j, q), __shfl_sync(FULL_MASK, a, q), __shfl_sync(FULL_MASK, b, q));
        },
        [&](int c0, int width) {
            for (int k = 0; k < width; k += 32) {
                const int col = k + lane;
                float a = 0.f, b = 0.f;
                if (col < width) {
                    a = __bfloat162float(dg[base + c0 + col]);
                    b = __bfloat162float(du[base + c0 + col]);
                }
                uint32_t mask = __ballot_sync(FULL_MASK, a != 0.f || b != 0.f);
                while (mask) {
                    const int q = __ffs(mask) - 1;
                    mask &= mask - 1;
                    add(c0 + k + q, __shfl_sync(FULL_MASK, a, q), __shfl_sync(FULL_MASK, b, q));
                }
            }
        });
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
        const int e = (lane + 32 * i) * VEC;
        if (e < d) store8(dx_out + row * d + e, acc[i]);
    }
}

#define BWD_ROW_KERNELS(MAXV)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) twell_mlp_bwd_grads_bf16_v##MAXV(                     \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dres,                       \
        const __nv_bfloat16* __restrict__ wg, const __nv_bfloat16* __restrict__ w_ud,                      \
        const uint32_t* __restrict__ counts, const uint8_t* __restrict__ indices,                          \
        const __nv_bfloat16* __restrict__ g_slots, const __nv_bfloat16* __restrict__ u_slots,              \
        __nv_bfloat16* __restrict__ h_out, __nv_bfloat16* __restrict__ dg_out,                             \
        __nv_bfloat16* __restrict__ du_out, __nv_bfloat16* __restrict__ dg_slots,                          \
        __nv_bfloat16* __restrict__ du_slots, int dense_all, int M, int d, int f, int tile, int cap,       \
        int n_tiles) {                                                                                     \
        grads_row<MAXV>(x, dres, wg, w_ud, counts, indices, g_slots, u_slots, h_out, dg_out, du_out,       \
                        dg_slots, du_slots, dense_all, M, d, f, tile, cap, n_tiles);                       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) twell_mlp_bwd_dx_bf16_v##MAXV(                        \
        const __nv_bfloat16* __restrict__ wg, const __nv_bfloat16* __restrict__ w_ud,                      \
        const uint32_t* __restrict__ counts, const uint8_t* __restrict__ indices,                          \
        const __nv_bfloat16* __restrict__ dg_slots, const __nv_bfloat16* __restrict__ du_slots,            \
        const __nv_bfloat16* __restrict__ dg, const __nv_bfloat16* __restrict__ du,                        \
        __nv_bfloat16* __restrict__ dx_out, int M, int d, int f, int tile, int cap, int n_tiles) {         \
        dx_row<MAXV>(wg, w_ud, counts, indices, dg_slots, du_slots, dg, du, dx_out, M, d, f, tile, cap,    \
                     n_tiles);                                                                             \
    }
BWD_ROW_KERNELS(1)
BWD_ROW_KERNELS(2)
BWD_ROW_KERNELS(4)
BWD_ROW_KERNELS(8)
BWD_ROW_KERNELS(16)

// ---- Sparse weight gradients ----
//
// Per neuron j, over the tokens t where it fired:
//   dWg_j = Σ dg_tj x_t,   dWu_j = Σ du_tj x_t,   dWd_j = Σ h_tj dout_t.
// The forward's pattern is token-major, so its pairs are first regrouped by neuron, a
// counting sort in three steps: `wgrad_pairs<true>` counts each neuron's pairs per chunk
// of PAIR_CHUNK tokens, the two scans turn the counts into places, and
// `wgrad_pairs<false>` writes each pair's slot index at its place. A (token, tile) past
// the capacity lists no slots: it goes on its tile's list of overflowing tokens (column
// f + tile of the counts), whose values the accumulation reads from the dense matrices.
// Ranks within a warp come from `__match_any_sync`, so the order (and the f32 sums) are
// the same on every run.
#define PAIR_CHUNK 128

template <bool COUNT>
__device__ void pairs_chunk(const uint32_t* __restrict__ counts,    // [M, n_tiles]
                            const uint8_t* __restrict__ indices,    // [M, n_tiles, cap]
                            uint32_t* __restrict__ chunk_counts,    // [n_chunks, f + n_tiles]
                            const uint32_t* __restrict__ starts,    // [f + n_tiles + 1]
                            uint32_t* __restrict__ pairs,
                            int M, int f, int tile, int cap, int n_tiles) {
    __shared__ uint32_t local[257];
    const int lane = threadIdx.x;
    const int chunk = blockIdx.x, t = blockIdx.y;
    const int width = min(tile, f - t * tile);
    const long long n_cols = static_cast<long long>(f) + n_tiles;
    // Local column `width` is the tile's overflow list.
    auto global_col = [&](int c) { return c == width ? f + t : t * tile + c; };
    for (int c = lane; c <= width; c += 32) local[c] = 0;
    __syncwarp();
    const long long first = static_cast<long long>(chunk) * PAIR_CHUNK;
    const long long last = min(static_cast<long long>(M), first + PAIR_CHUNK);
    for (long long r0 = first; r0 < last; r0 += 32) {
        const long long row = r0 + lane;
        const int n = row < last ? static_cast<int>(counts[row * n_tiles + t]) : 0;
        const bool over = n > cap;
        const int listed = over ? 1 : n;
        const int most = __reduce_max_sync(FULL_MASK, listed);
        const long long s0 = (row * n_tiles + t) * static_cast<long long>(cap);
        for (int k = 0; k < most; ++k) {
            int c = -1;
            uint32_t entry = 0;
            if (k < listed) {
                c = over ? width : indices[s0 + k];
                entry = over ? static_cast<uint32_t>(row) : static_cast<uint32_t>(s0 + k);
            }
            const uint32_t peers = __match_any_sync(FULL_MASK, c);
            const int rank = __popc(peers & ((1u << lane) - 1));
            const uint32_t before = c >= 0 ? local[c] : 0;
            if (!COUNT && c >= 0) {
                const int gc = global_col(c);
                pairs[starts[gc] + chunk_counts[chunk * n_cols + gc] + before + rank] = entry;
            }
            __syncwarp();
            if (c >= 0 && rank == 0) local[c] = before + __popc(peers);
            __syncwarp();
        }
    }
    if (COUNT)
        for (int c = lane; c <= width; c += 32) chunk_counts[chunk * n_cols + global_col(c)] = local[c];
}

// Grid (chunks, tiles), one warp each.
extern "C" __global__ void __launch_bounds__(32) twell_wgrad_pair_counts(
    const uint32_t* __restrict__ counts, const uint8_t* __restrict__ indices, uint32_t* __restrict__ chunk_counts,
    int M, int f, int tile, int cap, int n_tiles) {
    pairs_chunk<true>(counts, indices, chunk_counts, nullptr, nullptr, M, f, tile, cap, n_tiles);
}

extern "C" __global__ void __launch_bounds__(32) twell_wgrad_pair_places(
    const uint32_t* __restrict__ counts, const uint8_t* __restrict__ indices,
    const uint32_t* __restrict__ chunk_counts, const uint32_t* __restrict__ starts, uint32_t* __restrict__ pairs,
    int M, int f, int tile, int cap, int n_tiles) {
    pairs_chunk<false>(counts, indices, const_cast<uint32_t*>(chunk_counts), starts, pairs, M, f, tile, cap,
                       n_tiles);
}

// Each column's chunk counts become exclusive prefix sums over the chunks; the column
// totals go to `totals`. A thread per column.
extern "C" __global__ void twell_wgrad_scan_chunks(uint32_t* __restrict__ chunk_counts,
                                                   uint32_t* __restrict__ totals, int n_chunks, int n_cols) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n_cols) return;
    // Eight chunks' loads at a time are issued before their stores, so they overlap.
    constexpr int BATCH = 8;
    uint32_t running = 0;
    for (int k0 = 0; k0 < n_chunks; k0 += BATCH) {
        uint32_t v[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; ++k)
            v[k] = k0 + k < n_chunks ? chunk_counts[static_cast<long long>(k0 + k) * n_cols + c] : 0;
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            if (k0 + k < n_chunks) chunk_counts[static_cast<long long>(k0 + k) * n_cols + c] = running;
            running += v[k];
        }
    }
    totals[c] = running;
}

// starts[c] = Σ totals[< c], starts[n_cols] = all pairs: one block of SCAN_THREADS
// threads, each summing a contiguous run of columns.
#define SCAN_THREADS 1024
extern "C" __global__ void __launch_bounds__(SCAN_THREADS) twell_wgrad_scan_columns(
    const uint32_t* __restrict__ totals, uint32_t* __restrict__ starts, int n_cols) {
    __shared__ uint32_t warp_sums[SCAN_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int per = (n_cols + SCAN_THREADS - 1) / SCAN_THREADS;
    const int lo = min(n_cols, tid * per), hi = min(n_cols, lo + per);
    uint32_t mine = 0;
    for (int c = lo; c < hi; ++c) mine += totals[c];
    // Inclusive scan of the threads' sums: within each warp, then across warps.
    const uint32_t incl = warp_inclusive_sum(mine);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        warp_sums[lane] = warp_inclusive_sum(warp_sums[lane]);
    }
    __syncthreads();
    uint32_t running = incl - mine + (warp > 0 ? warp_sums[warp - 1] : 0);
    for (int c = lo; c < hi; ++c) {
        starts[c] = running;
        running += totals[c];
    }
    if (tid == SCAN_THREADS - 1) starts[n_cols] = running;
}

// One block per neuron j; thread i owns columns [8i, 8i + 8) of each blockDim.x * 8
// column chunk. SIDE 0 sums dWg_j and dWu_j from the rows of x, SIDE 1 sums dWd_j
// from the rows of dout (two kernels, so each one's rows, 2 · M · d bytes, stay in L2).
// A batch of blockDim.x pairs is staged in shared memory (token, coefficients), then
// every thread walks it with four rows' loads in flight.
template <int SIDE>
__device__ void wgrad_neuron(const __nv_bfloat16* __restrict__ rows,    // [M, d]: x or dout
                             const uint32_t* __restrict__ pairs, const uint32_t* __restrict__ starts,
                             const __nv_bfloat16* __restrict__ slots_a,  // dg (SIDE 0) or g
                             const __nv_bfloat16* __restrict__ slots_b,  // du (SIDE 0) or u
                             const __nv_bfloat16* __restrict__ dense_a,  // [M, f]: dg or h
                             const __nv_bfloat16* __restrict__ dense_b,  // [M, f]: du (SIDE 0)
                             __nv_bfloat16* __restrict__ out_a, long long ld_a,
                             __nv_bfloat16* __restrict__ out_b, long long ld_b,
                             int d, int f, int tile, int cap, int n_tiles) {
    constexpr int MAX_BATCH = 256;
    __shared__ uint32_t tok[MAX_BATCH];
    __shared__ float coef_a[MAX_BATCH], coef_b[MAX_BATCH];
    const int j = blockIdx.x;
    const int tid = threadIdx.x, nt = blockDim.x;
    const long long row_slots = static_cast<long long>(n_tiles) * cap;
    const int t = j / tile;
    const uint32_t ranges[2][2] = {{starts[j], starts[j + 1]}, {starts[f + t], starts[f + t + 1]}};
    for (int c0 = 0; c0 < d; c0 += nt * VEC) {
        const int e = c0 + tid * VEC;
        const bool mine = e < d;
        float acc_a[VEC], acc_b[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc_a[k] = acc_b[k] = 0.f;
        auto add = [&](const float* r, float a, float b) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                acc_a[k] = fmaf(a, r[k], acc_a[k]);
                if (SIDE == 0) acc_b[k] = fmaf(b, r[k], acc_b[k]);
            }
        };
        for (int range = 0; range < 2; ++range) {
            const bool overflow = range == 1;
            for (uint32_t b0 = ranges[range][0]; b0 < ranges[range][1]; b0 += nt) {
                const uint32_t i = b0 + tid;
                if (i < ranges[range][1]) {
                    const uint32_t entry = pairs[i];
                    float a, b = 0.f;
                    long long token;
                    if (!overflow) {
                        token = entry / row_slots;
                        const float sa = __bfloat162float(slots_a[entry]), sb = __bfloat162float(slots_b[entry]);
                        // SIDE 1: h = g · u, rounded as the forward's h was.
                        a = SIDE == 0 ? sa : round_bf16(sa * sb);
                        if (SIDE == 0) b = sb;
                    } else {
                        token = entry;
                        a = __bfloat162float(dense_a[token * f + j]);
                        if (SIDE == 0) b = __bfloat162float(dense_b[token * f + j]);
                    }
                    tok[tid] = static_cast<uint32_t>(token);
                    coef_a[tid] = a;
                    coef_b[tid] = b;
                }
                __syncthreads();
                const int n = min(nt, static_cast<int>(ranges[range][1] - b0));
                if (mine) {
                    int q = 0;
                    for (; q + 4 <= n; q += 4) {
                        float r[4][VEC];
#pragma unroll
                        for (int u = 0; u < 4; ++u) load8(rows + static_cast<long long>(tok[q + u]) * d + e, r[u]);
#pragma unroll
                        for (int u = 0; u < 4; ++u) add(r[u], coef_a[q + u], coef_b[q + u]);
                    }
                    for (; q < n; ++q) {
                        float r[VEC];
                        load8(rows + static_cast<long long>(tok[q]) * d + e, r);
                        add(r, coef_a[q], coef_b[q]);
                    }
                }
                __syncthreads();
            }
        }
        if (mine) {
            store8(out_a + j * ld_a + e, acc_a);
            if (SIDE == 0) store8(out_b + j * ld_b + e, acc_b);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) twell_wgrad_gate_up_bf16(
    const __nv_bfloat16* __restrict__ x, const uint32_t* __restrict__ pairs, const uint32_t* __restrict__ starts,
    const __nv_bfloat16* __restrict__ dg_slots, const __nv_bfloat16* __restrict__ du_slots,
    const __nv_bfloat16* __restrict__ dg, const __nv_bfloat16* __restrict__ du, __nv_bfloat16* __restrict__ dwg,
    __nv_bfloat16* __restrict__ dw_ud, int d, int f, int tile, int cap, int n_tiles) {
    wgrad_neuron<0>(x, pairs, starts, dg_slots, du_slots, dg, du, dwg, d, dw_ud, 2LL * d, d, f, tile, cap,
                    n_tiles);
}

extern "C" __global__ void __launch_bounds__(256) twell_wgrad_down_bf16(
    const __nv_bfloat16* __restrict__ dout, const uint32_t* __restrict__ pairs, const uint32_t* __restrict__ starts,
    const __nv_bfloat16* __restrict__ g_slots, const __nv_bfloat16* __restrict__ u_slots,
    const __nv_bfloat16* __restrict__ h, __nv_bfloat16* __restrict__ dw_ud, int d, int f, int tile, int cap,
    int n_tiles) {
    // dWd_j is the second half of row j of [f, 2d].
    wgrad_neuron<1>(dout, pairs, starts, g_slots, u_slots, h, nullptr, dw_ud + d, 2LL * d, nullptr, 0, d, f,
                    tile, cap, n_tiles);
}

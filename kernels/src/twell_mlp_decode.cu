// The whole ReGLU MLP of one token row (KV-cache decode) in one launch.
//
// The row of x sits in every warp's registers. The kernel runs in two phases, so that no
// warp waits on more than one memory round trip per step:
// 1. gates: a warp takes two neurons at a time and reads both gate rows Wg_j at once (all
//    their 16-byte loads in flight); each neuron whose gate is positive goes on its
//    block's list in shared memory;
// 2. the block's warps share its list: a warp reads a listed neuron's Wu_j and Wd_j (row
//    j of the neuron-major w_ud [f, 2d]) together, and adds h_j · Wd_j into the sums with
//    atomics, lanes on neighbouring sums so each atomic instruction covers whole lines.
//    The sums are fixed point in 64-bit integers (steps of 2^-32, |sum| < 2^31): integer
//    adds give the same sum in any order, so the output does not depend on which block
//    adds first. With f32 atomics it did, and greedy decoding differed from run to run.
// So the bytes read are Wg plus the active neurons' rows. A block whose list is full adds
// the neuron at once instead, so none is ever dropped.
//
// The sums, the L1 term and the per-tile counts live in a scratch buffer that the host
// keeps per stream, zeroed. The last block to finish (a ticket counter after a fence)
// turns the sums into the bf16 output row and the counts into the output counts, and
// zeroes the scratch again for the next launch on the stream. Given a residual row, it
// also writes the residual add and the next sublayer's RMS norm of it (and the MLP row
// and the counts only where asked: a decode step needs neither).
//
// In the `_norm` entry points x is the previous sublayer's output y, and the MLP's input
// is rms_norm(residual + y) · pre_alpha, which every block works out for itself at the
// start (two reads of a 4 KB row from L2), while its first gate rows are on their way;
// the sum then adds to `residual + y`. A decode step's MLP sublayer is then one launch:
// the add + norm before it, the MLP, the add + norm after it.
#include "mma_sync.cuh"
#include "rms_norm_row.cuh"

// The sums' fixed point: 2^32 steps per unit.
#define FIXED_ONE 4294967296.0f
// Each term is clamped to +-2^30 so that its conversion cannot overflow.
__device__ __forceinline__ unsigned long long to_fixed(float v) {
    return static_cast<unsigned long long>(__float2ll_rn(fminf(fmaxf(v, -1073741824.f), 1073741824.f) * FIXED_ONE));
}
__device__ __forceinline__ float from_fixed(uint32_t lo, uint32_t hi) {
    const long long s = static_cast<long long>((static_cast<unsigned long long>(hi) << 32) | lo);
    return __ll2float_rn(s) * (1.0f / FIXED_ONE);
}

// Active neurons one block lists between the phases (at 3% density a block holds 1-2).
#define DECODE_LIST 128
// The block is one norm block (`rms_norm_row.cuh`), so the folded norms partition the
// row as `add_rms_norm.cu` does.
#define DECODE_THREADS NORM_THREADS

// Rows w0 and w1 into registers, all their loads in flight at once (w1 may be null:
// zeros).
template <int MAXV>
__device__ __forceinline__ void load2(const __nv_bfloat16* __restrict__ w0, const __nv_bfloat16* __restrict__ w1,
                                      int d, uint4* a, uint4* b) {
    row_to_registers<MAXV>(w0, d, a);
    if (w1 != nullptr) {
        row_to_registers<MAXV>(w1, d, b);
    } else {
#pragma unroll
        for (int i = 0; i < MAXV; ++i) b[i] = make_uint4(0u, 0u, 0u, 0u);
    }
}

// x . a and x . b for rows held as `load2` leaves them.
template <int MAXV>
__device__ __forceinline__ void dot2(const uint4* r, const uint4* a, const uint4* b, float& s0, float& s1) {
    float p0 = 0.f, p1 = 0.f;
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
        const __nv_bfloat162* rh = reinterpret_cast<const __nv_bfloat162*>(&r[i]);
        const __nv_bfloat162* ah = reinterpret_cast<const __nv_bfloat162*>(&a[i]);
        const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&b[i]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 rf = __bfloat1622float2(rh[q]);
            const float2 af = __bfloat1622float2(ah[q]);
            const float2 bf = __bfloat1622float2(bh[q]);
            p0 = fmaf(rf.x, af.x, fmaf(rf.y, af.y, p0));
            p1 = fmaf(rf.x, bf.x, fmaf(rf.y, bf.y, p1));
        }
    }
    s0 = warp_sum(p0);
    s1 = warp_sum(p1);
}

// Adds active neuron j (gate g > 0) into the sums: h = g · (x . Wu_j), acc += h · Wd_j.
// Wu_j and Wd_j are read together; Wd_j by bf16 pairs, lane l taking pairs l, l + 32, ...
template <int MAXV>
__device__ __forceinline__ void add_neuron(const uint4* xr, const __nv_bfloat16* __restrict__ w_ud, long long j,
                                           float g, int d, int tile, unsigned long long* acc, float* l1,
                                           uint32_t* tile_counts) {
    const int lane = threadIdx.x & 31;
    const __nv_bfloat16* row = w_ud + j * 2 * d;
    uint4 wu[MAXV];
    row_to_registers<MAXV>(row, d, wu);
    uint32_t wd[4 * MAXV];
#pragma unroll
    for (int i = 0; i < 4 * MAXV; ++i) {
        const int e = 2 * (lane + 32 * i);
        wd[i] = e < d ? *reinterpret_cast<const uint32_t*>(row + d + e) : 0u;
    }
    float part = 0.f;
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
        const __nv_bfloat162* rh = reinterpret_cast<const __nv_bfloat162*>(&xr[i]);
        const __nv_bfloat162* uh = reinterpret_cast<const __nv_bfloat162*>(&wu[i]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 rf = __bfloat1622float2(rh[q]);
            const float2 uf = __bfloat1622float2(uh[q]);
            part = fmaf(rf.x, uf.x, fmaf(rf.y, uf.y, part));
        }
    }
    const float h = round_bf16(g * warp_sum(part));
#pragma unroll
    for (int i = 0; i < 4 * MAXV; ++i) {
        const int e = 2 * (lane + 32 * i);
        if (e < d) {
            const float2 wf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wd[i]));
            red_add(acc + e, to_fixed(h * wf.x));
            red_add(acc + e + 1, to_fixed(h * wf.y));
        }
    }
    if (lane == 0) {
        red_add(l1, fabsf(h));
        red_add(tile_counts + j / tile, 1u);
    }
}

// `add_neuron` out of line, for the rare neuron that finds its block's list full: inlined,
// its row registers would count against the gate loop's, which then spills.
template <int MAXV>
__device__ __noinline__ void add_neuron_overflow(const uint4* xr, const __nv_bfloat16* __restrict__ w_ud,
                                                 long long j, float g, int d, int tile, unsigned long long* acc, float* l1,
                                                 uint32_t* tile_counts) {
    add_neuron<MAXV>(xr, w_ud, j, g, d, tile, acc, l1, tile_counts);
}

template <int MAXV, bool PRE>
__device__ void decode_row(const __nv_bfloat16* __restrict__ x,     // [1, d]: the input, or y with pre_alpha
                           const __nv_bfloat16* __restrict__ wg,    // [f, d]
                           const __nv_bfloat16* __restrict__ w_ud,  // [f, 2d]: Wu_j then Wd_j
                           unsigned long long* acc,                 // scratch [d] fixed point, zero
                           float* l1,                               // scratch [1], zero
                           uint32_t* tile_counts,                   // scratch [n_tiles], zero
                           uint32_t* ticket,                        // scratch, zero
                           __nv_bfloat16* __restrict__ out,         // [1, d], then the L1 term; or null
                           uint32_t* __restrict__ counts,           // [1, n_tiles], or null
                           int d, int f, int tile, int n_tiles,
                           const __nv_bfloat16* __restrict__ residual,   // [1, d], or null
                           const __nv_bfloat16* __restrict__ alpha,      // [d] norm weight
                           __nv_bfloat16* __restrict__ sum_normed,       // [2, d]
                           float eps,
                           const __nv_bfloat16* __restrict__ pre_alpha,  // [d] with PRE
                           float pre_eps) {
    // The norm's 16-byte vectors per thread: MAXV · 32 vectors over the block.
    constexpr int NV = (MAXV * 32 + DECODE_THREADS - 1) / DECODE_THREADS;
    __shared__ int listed_j[DECODE_LIST];
    __shared__ float listed_g[DECODE_LIST];
    __shared__ int n_listed;
    if (threadIdx.x == 0) n_listed = 0;
    const int lane = threadIdx.x & 31;
    const int vecs = d / VEC;

    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
    uint4 xr[MAXV];
    // The warp's first two gate rows do not depend on x: their loads go out before the
    // input is worked out, so they are on their way during the prologue.
    uint4 wa[MAXV], wb[MAXV];
    {
        const long long j = global_warp(), j2 = j + warps;
        if (j < f) load2<MAXV>(wg + j * d, j2 < f ? wg + j2 * d : nullptr, d, wa, wb);
    }
    if constexpr (PRE) {
        // The MLP's input, rms_norm(residual + y) · pre_alpha, through shared memory
        // into every warp's registers.
        __shared__ __align__(16) __nv_bfloat16 row_in[MAXV * 32 * VEC];
        uint4 r[NV], y[NV], al[NV];
        float sum[NV][VEC];
        norm_row_load<NV>(residual, vecs, r);
        norm_row_load<NV>(x, vecs, y);
        norm_row_load<NV>(pre_alpha, vecs, al);
        const float scale = norm_row_scale(norm_row_add<NV>(r, y, sum), d, pre_eps);
        norm_row_store_scaled<NV>(row_in, vecs, scale, sum, al);
        __syncthreads();
        row_to_registers<MAXV>(row_in, d, xr);
    } else {
        __syncthreads();  // n_listed
        row_to_registers<MAXV>(x, d, xr);
    }

    // Phase 1: the gates, two neurons per warp-step.
    for (long long j = global_warp(); j < f; j += 2 * warps) {
        const long long j2 = j + warps;
        if (j != global_warp()) load2<MAXV>(wg + j * d, j2 < f ? wg + j2 * d : nullptr, d, wa, wb);
        float g[2];
        dot2<MAXV>(xr, wa, wb, g[0], g[1]);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            // The gate rounds to bf16, as the cuBLAS gate of the other paths does.
            const float gk = round_bf16(g[k]);
            const long long jk = k == 0 ? j : j2;
            if (gk <= 0.f || jk >= f) continue;  // the same in every lane
            int slot = 0;
            if (lane == 0) slot = atomicAdd(&n_listed, 1);
            slot = __shfl_sync(FULL_MASK, slot, 0);
            if (slot < DECODE_LIST) {
                if (lane == 0) {
                    listed_j[slot] = static_cast<int>(jk);
                    listed_g[slot] = gk;
                }
            } else {
                add_neuron_overflow<MAXV>(xr, w_ud, jk, gk, d, tile, acc, l1, tile_counts);
            }
        }
    }
    __syncthreads();

    // Phase 2: the block's listed neurons, shared by its warps.
    const int listed = min(n_listed, DECODE_LIST);
    for (int s = threadIdx.x >> 5; s < listed; s += blockDim.x >> 5)
        add_neuron<MAXV>(xr, w_ud, listed_j[s], listed_g[s], d, tile, acc, l1, tile_counts);

    // The last block out writes the results and leaves the scratch zeroed.
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // This block runs alone, so its round trips to L2 are the kernel's tail: every read
    // (the sums, and for the folded norm the residual, y and alpha) goes out at once.
    uint4 mlp[NV], r[NV], y[NV], al[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int v = threadIdx.x + i * DECODE_THREADS;
        mlp[i] = make_uint4(0u, 0u, 0u, 0u);
        if (v < vecs) {
            // The VEC sums, two to a 16-byte load (each 64-bit sum as low, high word).
            uint4* sums = reinterpret_cast<uint4*>(acc + v * VEC);
            __nv_bfloat162* m = reinterpret_cast<__nv_bfloat162*>(&mlp[i]);
#pragma unroll
            for (int k = 0; k < VEC / 2; ++k) {
                const uint4 p = __ldcg(sums + k);
                sums[k] = make_uint4(0u, 0u, 0u, 0u);
                // The row as the bf16 output holds it: the sum below adds these values.
                m[k] = __floats2bfloat162_rn(from_fixed(p.x, p.y), from_fixed(p.z, p.w));
            }
            if (out != nullptr) *reinterpret_cast<uint4*>(out + v * VEC) = mlp[i];
        }
    }
    if (residual != nullptr) {
        norm_row_load<NV>(residual, vecs, r);
        norm_row_load<NV>(alpha, vecs, al);
        if constexpr (PRE) norm_row_load<NV>(x, vecs, y);
    }
    if (threadIdx.x == 0) {
        if (out != nullptr) out[l1_at(1, d, 0)] = __float2bfloat16(__ldcg(l1));
        *l1 = 0.f;
    }
    for (int t = threadIdx.x; t < n_tiles; t += blockDim.x) {
        if (counts != nullptr) counts[t] = __ldcg(tile_counts + t);
        tile_counts[t] = 0u;
    }
    if (threadIdx.x == 0) *ticket = 0u;
    if (residual == nullptr) return;
    // The residual add and the next sublayer's RMS norm: with the norm before the MLP
    // folded in too, the residual is that norm's sum, residual + y, worked out again.
    uint4 h[NV];
    float sum[NV][VEC];
    if constexpr (PRE) {
        // residual + y again, as the prologue rounded it (exact in bf16 once rounded).
        float hf[NV][VEC];
        norm_row_add<NV>(r, y, hf);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            __nv_bfloat162* hh = reinterpret_cast<__nv_bfloat162*>(&h[i]);
#pragma unroll
            for (int q = 0; q < VEC / 2; ++q) hh[q] = __floats2bfloat162_rn(hf[i][2 * q], hf[i][2 * q + 1]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < NV; ++i) h[i] = r[i];
    }
    const float scale = norm_row_scale(norm_row_add<NV>(h, mlp, sum), d, eps);
    norm_row_store<NV>(sum_normed, vecs, sum);
    norm_row_store_scaled<NV>(sum_normed + d, vecs, scale, sum, al);
}

// Two blocks per multiprocessor where the row fits 128 registers a thread (up to d = 2048):
// twice the loads in flight. At d = 4096 that bound would spill the rows, so one block.
// The entry points with the norm before the MLP folded in (`_norm`) are their own
// instantiations: the prologue's registers would otherwise spill the plain kernel's loop.
#define DECODE_KERNEL(NAME, PRE, MAXV, MIN_BLOCKS)                                                    \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, MIN_BLOCKS) NAME##_bf16_v##MAXV(     \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wg,                   \
        const __nv_bfloat16* __restrict__ w_ud, unsigned long long* acc, float* l1,                   \
        uint32_t* tile_counts,                                                                        \
        uint32_t* ticket, __nv_bfloat16* __restrict__ out, uint32_t* __restrict__ counts, int d,      \
        int f, int tile, int n_tiles, const __nv_bfloat16* __restrict__ residual,                    \
        const __nv_bfloat16* __restrict__ alpha, __nv_bfloat16* __restrict__ sum_normed, float eps,   \
        const __nv_bfloat16* __restrict__ pre_alpha, float pre_eps) {                                 \
        decode_row<MAXV, PRE>(x, wg, w_ud, acc, l1, tile_counts, ticket, out, counts, d, f, tile,     \
                              n_tiles, residual, alpha, sum_normed, eps, pre_alpha, pre_eps);         \
    }
#define DECODE_KERNELS(MAXV, MIN_BLOCKS)                          \
    DECODE_KERNEL(twell_mlp_decode, false, MAXV, MIN_BLOCKS)      \
    DECODE_KERNEL(twell_mlp_decode_norm, true, MAXV, MIN_BLOCKS)

DECODE_KERNELS(1, 2)
DECODE_KERNELS(2, 2)
DECODE_KERNELS(4, 2)
DECODE_KERNELS(8, 2)
DECODE_KERNELS(16, 1)

// ---------------------------------------------------------------------------------------
// A few token rows (2 to R) in one launch: a batched decode step.
//
// The same two phases as one row, with every gate row and every active neuron's Wu_j and
// Wd_j read once for all the rows: the rows of x wait in shared memory (a warp loads one
// into registers at a time), a neuron goes on its block's list with the bit mask of the
// rows whose gate is positive, and phase 2 adds h_rj · Wd_j into row r's fixed-point
// sums for each of them. The bytes read are Wg plus the union of the rows' active
// neurons, where the staged kernels (gate GEMM, pack, up, down) read the gate three
// times and launch four kernels. The last block writes the rows, their L1 terms and
// counts, and (given a residual) the residual add and RMS norm of each row, four rows'
// loads in flight at a time.
//
// x is the MLP's input (no norm before the MLP folded in). Shared memory: the m rows of
// x (dynamic, m · d bf16), the block's list.
#define FEW_ROWS_AT_ONCE 4

// Lane r < R adds row r's |h| to its L1 term and counts neuron j in row r's tile.
template <int R>
__device__ __forceinline__ void count_neuron_rows(const float* h, uint32_t mask, long long j, int tile, int n_tiles,
                                                  float* l1, uint32_t* tile_counts) {
    const int lane = threadIdx.x & 31;
    if (lane < R && ((mask >> lane) & 1u)) {
        float mine = 0.f;
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r == lane) mine = h[r];
        red_add(l1 + lane, fabsf(mine));
        red_add(tile_counts + lane * n_tiles + j / tile, 1u);
    }
}

// Adds active neuron j into the sums of the rows in `mask` (row r's gate g[r] > 0):
// h_r = g_r · (x_r . Wu_j), acc_r += h_r · Wd_j. Wu_j and Wd_j are read once for all rows.
template <int MAXV, int R>
__device__ __forceinline__ void add_neuron_rows(const __nv_bfloat16* xs, const __nv_bfloat16* __restrict__ w_ud,
                                                long long j, uint32_t mask, const float* g, int d, int tile,
                                                int n_tiles, unsigned long long* acc, float* l1,
                                                uint32_t* tile_counts) {
    const int lane = threadIdx.x & 31;
    const __nv_bfloat16* row = w_ud + j * 2 * d;
    uint4 wu[MAXV];
    row_to_registers<MAXV>(row, d, wu);
    uint32_t wd[4 * MAXV];
#pragma unroll
    for (int i = 0; i < 4 * MAXV; ++i) {
        const int e = 2 * (lane + 32 * i);
        wd[i] = e < d ? *reinterpret_cast<const uint32_t*>(row + d + e) : 0u;
    }
    float h[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        h[r] = 0.f;
        if ((mask >> r) & 1u) {  // the same in every lane
            uint4 xr[MAXV];
            row_to_registers<MAXV>(xs + r * d, d, xr);
            float part = 0.f;
#pragma unroll
            for (int i = 0; i < MAXV; ++i) {
                const __nv_bfloat162* rh = reinterpret_cast<const __nv_bfloat162*>(&xr[i]);
                const __nv_bfloat162* uh = reinterpret_cast<const __nv_bfloat162*>(&wu[i]);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float2 rf = __bfloat1622float2(rh[q]);
                    const float2 uf = __bfloat1622float2(uh[q]);
                    part = fmaf(rf.x, uf.x, fmaf(rf.y, uf.y, part));
                }
            }
            h[r] = round_bf16(g[r] * warp_sum(part));
        }
    }
#pragma unroll
    for (int i = 0; i < 4 * MAXV; ++i) {
        const int e = 2 * (lane + 32 * i);
        if (e < d) {
            const float2 wf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wd[i]));
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if ((mask >> r) & 1u) {
                    red_add(acc + static_cast<long long>(r) * d + e, to_fixed(h[r] * wf.x));
                    red_add(acc + static_cast<long long>(r) * d + e + 1, to_fixed(h[r] * wf.y));
                }
            }
        }
    }
    count_neuron_rows<R>(h, mask, j, tile, n_tiles, l1, tile_counts);
}

template <int MAXV, int R>
__device__ __noinline__ void add_neuron_rows_overflow(const __nv_bfloat16* xs, const __nv_bfloat16* __restrict__ w_ud,
                                                      long long j, uint32_t mask, const float* g, int d, int tile,
                                                      int n_tiles, unsigned long long* acc, float* l1,
                                                      uint32_t* tile_counts) {
    add_neuron_rows<MAXV, R>(xs, w_ud, j, mask, g, d, tile, n_tiles, acc, l1, tile_counts);
}

// Whether this block is the last of the launch to finish (a ticket after a fence); every
// block's adds are then visible to it.
__device__ __forceinline__ bool last_block_out(uint32_t* ticket) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// The last block's work for m rows: each row's sums into the bf16 output row (and, given
// a residual, the residual add and RMS norm of it), the L1 terms and counts, the scratch
// zeroed again. NV 16-byte vectors a thread cover the row (d <= NV · 2048).
template <int NV>
__device__ void finish_rows(unsigned long long* acc, float* l1, uint32_t* tile_counts, uint32_t* ticket,
                            __nv_bfloat16* __restrict__ out, uint32_t* __restrict__ counts, int m, int d, int n_tiles,
                            const __nv_bfloat16* __restrict__ residual, const __nv_bfloat16* __restrict__ alpha,
                            __nv_bfloat16* __restrict__ sum_normed, float eps) {
    const int vecs = d / VEC;
    uint4 al[NV];
    if (residual != nullptr) norm_row_load<NV>(alpha, vecs, al);
    for (int r0 = 0; r0 < m; r0 += FEW_ROWS_AT_ONCE) {
        uint4 mlp[FEW_ROWS_AT_ONCE][NV], res[FEW_ROWS_AT_ONCE][NV];
#pragma unroll
        for (int q = 0; q < FEW_ROWS_AT_ONCE; ++q) {
            const int r = r0 + q;
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int v = threadIdx.x + i * DECODE_THREADS;
                mlp[q][i] = make_uint4(0u, 0u, 0u, 0u);
                res[q][i] = make_uint4(0u, 0u, 0u, 0u);
                if (r < m && v < vecs) {
                    uint4* sums = reinterpret_cast<uint4*>(acc + static_cast<long long>(r) * d + v * VEC);
                    __nv_bfloat162* mh = reinterpret_cast<__nv_bfloat162*>(&mlp[q][i]);
#pragma unroll
                    for (int k = 0; k < VEC / 2; ++k) {
                        const uint4 p = __ldcg(sums + k);
                        sums[k] = make_uint4(0u, 0u, 0u, 0u);
                        mh[k] = __floats2bfloat162_rn(from_fixed(p.x, p.y), from_fixed(p.z, p.w));
                    }
                    if (out != nullptr) *reinterpret_cast<uint4*>(out + static_cast<long long>(r) * d + v * VEC) = mlp[q][i];
                    if (residual != nullptr)
                        res[q][i] = *reinterpret_cast<const uint4*>(residual + static_cast<long long>(r) * d + v * VEC);
                }
            }
        }
        if (residual == nullptr) continue;
#pragma unroll
        for (int q = 0; q < FEW_ROWS_AT_ONCE; ++q) {
            const int r = r0 + q;
            if (r >= m) break;  // the same in every thread
            float sum[NV][VEC];
            const float scale = norm_row_scale(norm_row_add<NV>(res[q], mlp[q], sum), d, eps);
            norm_row_store<NV>(sum_normed + static_cast<long long>(r) * d, vecs, sum);
            norm_row_store_scaled<NV>(sum_normed + static_cast<long long>(m + r) * d, vecs, scale, sum, al);
        }
    }
    for (int r = threadIdx.x; r < m; r += blockDim.x) {
        if (out != nullptr) out[l1_at(m, d, r)] = __float2bfloat16(__ldcg(l1 + r));
        l1[r] = 0.f;
    }
    for (int t = threadIdx.x; t < m * n_tiles; t += blockDim.x) {
        if (counts != nullptr) counts[t] = __ldcg(tile_counts + t);
        tile_counts[t] = 0u;
    }
    if (threadIdx.x == 0) *ticket = 0u;
}

template <int MAXV, int R>
__device__ void decode_rows(const __nv_bfloat16* __restrict__ x,     // [m, d]
                            const __nv_bfloat16* __restrict__ wg,    // [f, d]
                            const __nv_bfloat16* __restrict__ w_ud,  // [f, 2d]: Wu_j then Wd_j
                            unsigned long long* acc,                 // scratch [R, d] fixed point, zero
                            float* l1,                               // scratch [R], zero
                            uint32_t* tile_counts,                   // scratch [R, n_tiles], zero
                            uint32_t* ticket,                        // scratch, zero
                            __nv_bfloat16* __restrict__ out,         // [m, d], then m L1 terms; or null
                            uint32_t* __restrict__ counts,           // [m, n_tiles], or null
                            int m, int d, int f, int tile, int n_tiles,
                            const __nv_bfloat16* __restrict__ residual,  // [m, d], or null
                            const __nv_bfloat16* __restrict__ alpha,     // [d] norm weight
                            __nv_bfloat16* __restrict__ sum_normed,      // [2, m, d]: sums, then norms
                            float eps) {
    constexpr int NV = (MAXV * 32 + DECODE_THREADS - 1) / DECODE_THREADS;
    extern __shared__ __align__(16) unsigned char few_rows_smem[];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(few_rows_smem);
    __shared__ int listed_j[DECODE_LIST];
    __shared__ uint32_t listed_mask[DECODE_LIST];
    __shared__ float listed_g[DECODE_LIST * R];
    __shared__ int n_listed;
    if (threadIdx.x == 0) n_listed = 0;
    const int lane = threadIdx.x & 31;
    const int vecs = d / VEC;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);

    uint4 wa[MAXV], wb[MAXV];
    {
        const long long j = global_warp(), j2 = j + warps;
        if (j < f) load2<MAXV>(wg + j * d, j2 < f ? wg + j2 * d : nullptr, d, wa, wb);
    }
    for (int v = threadIdx.x; v < m * vecs; v += blockDim.x)
        reinterpret_cast<uint4*>(xs)[v] = reinterpret_cast<const uint4*>(x)[v];
    __syncthreads();  // xs, n_listed

    // Phase 1: the gates of every row, two neurons per warp-step.
    for (long long j = global_warp(); j < f; j += 2 * warps) {
        const long long j2 = j + warps;
        if (j != global_warp()) load2<MAXV>(wg + j * d, j2 < f ? wg + j2 * d : nullptr, d, wa, wb);
        float ga[R], gb[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            ga[r] = 0.f;
            gb[r] = 0.f;
            if (r < m) {
                uint4 xr[MAXV];
                row_to_registers<MAXV>(xs + r * d, d, xr);
                dot2<MAXV>(xr, wa, wb, ga[r], gb[r]);
                ga[r] = round_bf16(ga[r]);
                gb[r] = round_bf16(gb[r]);
            }
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const long long jk = k == 0 ? j : j2;
            uint32_t mask = 0u;
            float mine = 0.f;  // lane r < R: row r's gate
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float gr = k == 0 ? ga[r] : gb[r];
                if (gr > 0.f) mask |= 1u << r;
                if (r == lane) mine = gr;
            }
            if (mask == 0u || jk >= f) continue;  // the same in every lane
            int slot = 0;
            if (lane == 0) slot = atomicAdd(&n_listed, 1);
            slot = __shfl_sync(FULL_MASK, slot, 0);
            if (slot < DECODE_LIST) {
                if (lane == 0) {
                    listed_j[slot] = static_cast<int>(jk);
                    listed_mask[slot] = mask;
                }
                if (lane < R) listed_g[slot * R + lane] = mine;
            } else {
                float g[R];
#pragma unroll
                for (int r = 0; r < R; ++r) g[r] = __shfl_sync(FULL_MASK, mine, r);
                add_neuron_rows_overflow<MAXV, R>(xs, w_ud, jk, mask, g, d, tile, n_tiles, acc, l1, tile_counts);
            }
        }
    }
    __syncthreads();

    // Phase 2: the block's listed neurons, shared by its warps.
    const int listed = min(n_listed, DECODE_LIST);
    for (int s = threadIdx.x >> 5; s < listed; s += blockDim.x >> 5)
        add_neuron_rows<MAXV, R>(xs, w_ud, listed_j[s], listed_mask[s], listed_g + s * R, d, tile, n_tiles, acc, l1,
                                 tile_counts);

    if (!last_block_out(ticket)) return;
    finish_rows<NV>(acc, l1, tile_counts, ticket, out, counts, m, d, n_tiles, residual, alpha, sum_normed, eps);
}

// One block a multiprocessor: the rows' gates and the gate rows in flight take the
// registers of two.
#define ROWS_KERNEL(MAXV, R)                                                                          \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 1) twell_mlp_decode_rows##R##_bf16_v##MAXV( \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wg,                   \
        const __nv_bfloat16* __restrict__ w_ud, unsigned long long* acc, float* l1,                   \
        uint32_t* tile_counts, uint32_t* ticket, __nv_bfloat16* __restrict__ out,                     \
        uint32_t* __restrict__ counts, int m, int d, int f, int tile, int n_tiles,                    \
        const __nv_bfloat16* __restrict__ residual, const __nv_bfloat16* __restrict__ alpha,          \
        __nv_bfloat16* __restrict__ sum_normed, float eps) {                                          \
        decode_rows<MAXV, R>(x, wg, w_ud, acc, l1, tile_counts, ticket, out, counts, m, d, f, tile,   \
                             n_tiles, residual, alpha, sum_normed, eps);                              \
    }
#define ROWS_KERNELS(R) ROWS_KERNEL(1, R) ROWS_KERNEL(2, R) ROWS_KERNEL(4, R) ROWS_KERNEL(8, R)

ROWS_KERNELS(4)
ROWS_KERNELS(8)
ROWS_KERNELS(16)

// ---------------------------------------------------------------------------------------
// A few token rows (2 to 8 · NT) with the gates on the tensor cores.
//
// The CUDA-core kernel above converts every gate row once for each row of x, so its cost
// grows with m · d · f and it loses to the staged kernels past a few rows of the wider
// shapes. Here a block takes 16 neurons at a time and computes their gates for all the
// rows as m16n8k16 products: the 16 gate rows are the A operand, the rows of x (zero past
// m) the B operand, with f32 sums. The block's 8 warps split the hidden size into
// 32-column chunks and add their partial products in a fixed order, so the gates do not
// depend on the schedule.
//
// Within a chunk the columns are taken in a permuted order, which leaves every dot product
// unchanged: lane (q, t) = (lane / 4, lane % 4) reads 16 contiguous bytes (columns 8t to
// 8t + 7) of gate rows q and q + 8 and of x rows q + 8n, and feeds words 0, 1 to the
// chunk's first k-step and words 2, 3 to its second, as the fragments' columns 2t, 2t + 1
// and 2t + 8, 2t + 9. A and B take the same permutation, so each product pairs the same
// column of the gate row and of x.
//
// The active neurons go on the block's list with the mask of their rows, and phase 2 adds
// them as the CUDA-core kernel does, its loops running over the row so that any hidden
// size (a multiple of 32, up to 2048 · NV) runs; the rows of x are read from L2. A block
// whose list could not take another 16 neurons adds the listed ones first, so none is
// dropped.
#define TC_NEURONS 16
#define TC_WARPS (DECODE_THREADS / 32)
#define TC_CHUNK 32
// 32-column chunks a warp has in flight at once.
#define TC_UNROLL 4

__device__ __forceinline__ uint32_t word_of(const uint4& v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// Adds active neuron j into the sums of the rows in `mask`, as `add_neuron_rows` does, for
// any hidden size: Wu_j and each masked row of x in 256-column passes, then Wd_j by bf16
// pairs.
template <int R>
__device__ void add_neuron_rows_wide(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,
                                     long long j, uint32_t mask, const float* g, int d, int tile, int n_tiles,
                                     unsigned long long* acc, float* l1, uint32_t* tile_counts) {
    const int lane = threadIdx.x & 31;
    const __nv_bfloat16* row = w_ud + j * 2 * d;
    float part[R];
#pragma unroll
    for (int r = 0; r < R; ++r) part[r] = 0.f;
#pragma unroll 4
    for (int e = lane * VEC; e < d; e += 32 * VEC) {
        const uint4 u = __ldg(reinterpret_cast<const uint4*>(row + e));
#pragma unroll
        for (int r = 0; r < R; ++r)
            if ((mask >> r) & 1u)  // the same in every lane
                part[r] = dot8_acc(__ldg(reinterpret_cast<const uint4*>(x + static_cast<long long>(r) * d + e)), u, part[r]);
    }
    float h[R];
#pragma unroll
    for (int r = 0; r < R; ++r) h[r] = (mask >> r) & 1u ? round_bf16(g[r] * warp_sum(part[r])) : 0.f;
#pragma unroll 4
    for (int e = 2 * lane; e < d; e += 64) {
        const float2 wf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + d + e));
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if ((mask >> r) & 1u) {
                red_add(acc + static_cast<long long>(r) * d + e, to_fixed(h[r] * wf.x));
                red_add(acc + static_cast<long long>(r) * d + e + 1, to_fixed(h[r] * wf.y));
            }
        }
    }
    count_neuron_rows<R>(h, mask, j, tile, n_tiles, l1, tile_counts);
}

template <int NT, int NV>
__device__ void decode_rows_tc(const __nv_bfloat16* __restrict__ x,     // [m, d]
                               const __nv_bfloat16* __restrict__ wg,    // [f, d]
                               const __nv_bfloat16* __restrict__ w_ud,  // [f, 2d]
                               unsigned long long* acc, float* l1, uint32_t* tile_counts, uint32_t* ticket,
                               __nv_bfloat16* __restrict__ out, uint32_t* __restrict__ counts, int m, int d, int f,
                               int tile, int n_tiles, const __nv_bfloat16* __restrict__ residual,
                               const __nv_bfloat16* __restrict__ alpha, __nv_bfloat16* __restrict__ sum_normed,
                               float eps) {
    constexpr int R = 8 * NT;
    __shared__ float partial[TC_WARPS][TC_NEURONS][R];
    __shared__ int listed_j[DECODE_LIST];
    __shared__ uint32_t listed_mask[DECODE_LIST];
    __shared__ float listed_g[DECODE_LIST * R];
    __shared__ int n_listed;
    if (threadIdx.x == 0) n_listed = 0;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q = lane >> 2, t = lane & 3;
    const int chunks = d / TC_CHUNK;
    const int groups = (f + TC_NEURONS - 1) / TC_NEURONS;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    for (int grp = blockIdx.x; grp < groups; grp += gridDim.x) {
        __syncthreads();  // n_listed, and the last group's partial sums read
        // Room for this group's 16: else the listed neurons go first.
        if (n_listed > DECODE_LIST - TC_NEURONS) {
            for (int s = warp; s < n_listed; s += TC_WARPS)
                add_neuron_rows_wide<R>(x, w_ud, listed_j[s], listed_mask[s], listed_g + s * R, d, tile, n_tiles,
                                        acc, l1, tile_counts);
            __syncthreads();
            if (threadIdx.x == 0) n_listed = 0;
        }
        const long long j0 = static_cast<long long>(grp) * TC_NEURONS;
        const bool row_a = j0 + q < f, row_b = j0 + q + 8 < f;
        const __nv_bfloat16* wa = wg + (j0 + q) * d + VEC * t;
        const __nv_bfloat16* wb = wg + (j0 + q + 8) * d + VEC * t;
        float c[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
        for (int c0 = warp; c0 < chunks; c0 += TC_WARPS * TC_UNROLL) {
            uint4 a[TC_UNROLL], b[TC_UNROLL], xv[TC_UNROLL][NT];
#pragma unroll
            for (int u = 0; u < TC_UNROLL; ++u) {
                const int ch = c0 + u * TC_WARPS;
                const bool in = ch < chunks;
                a[u] = in && row_a ? __ldcs(reinterpret_cast<const uint4*>(wa + ch * TC_CHUNK)) : zero;
                b[u] = in && row_b ? __ldcs(reinterpret_cast<const uint4*>(wb + ch * TC_CHUNK)) : zero;
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int r = q + 8 * n;
                    xv[u][n] = in && r < m ? __ldg(reinterpret_cast<const uint4*>(x + static_cast<long long>(r) * d +
                                                                                   ch * TC_CHUNK + VEC * t))
                                           : zero;
                }
            }
#pragma unroll
            for (int u = 0; u < TC_UNROLL; ++u) {
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const uint32_t af[4] = {word_of(a[u], 2 * s), word_of(b[u], 2 * s), word_of(a[u], 2 * s + 1),
                                            word_of(b[u], 2 * s + 1)};
#pragma unroll
                    for (int n = 0; n < NT; ++n)
                        mma_16816(c[n], af, word_of(xv[u][n], 2 * s), word_of(xv[u][n], 2 * s + 1));
                }
            }
        }
        // c[n]: neuron q (0, 1) and q + 8 (2, 3), rows 8n + 2t and 8n + 2t + 1.
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            partial[warp][q][8 * n + 2 * t] = c[n][0];
            partial[warp][q][8 * n + 2 * t + 1] = c[n][1];
            partial[warp][q + 8][8 * n + 2 * t] = c[n][2];
            partial[warp][q + 8][8 * n + 2 * t + 1] = c[n][3];
        }
        __syncthreads();
        // Thread (neuron, row) adds the warps' parts in warp order; R threads a neuron, so a
        // warp holds 32 / R whole neurons and one ballot gives each its row mask.
        if (threadIdx.x < TC_NEURONS * R) {  // the same in every lane of a warp
            const int nj = threadIdx.x / R, r = threadIdx.x % R;
            float g = 0.f;
#pragma unroll
            for (int w = 0; w < TC_WARPS; ++w) g += partial[w][nj][r];
            g = round_bf16(g);  // as the cuBLAS gate of the other paths rounds it
            const long long j = j0 + nj;
            const bool active = g > 0.f && r < m && j < f;
            const uint32_t bits = __ballot_sync(FULL_MASK, active);
            const int first = lane - r;  // this neuron's row-0 lane
            const uint32_t mask = (bits >> first) & (R == 32 ? FULL_MASK : ((1u << R) - 1u));
            int slot = 0;
            if (r == 0 && mask != 0u) slot = atomicAdd(&n_listed, 1);
            slot = __shfl_sync(FULL_MASK, slot, first);
            if (mask != 0u) {
                if (r == 0) {
                    listed_j[slot] = static_cast<int>(j);
                    listed_mask[slot] = mask;
                }
                listed_g[slot * R + r] = g;
            }
        }
    }
    __syncthreads();

    // Phase 2: the block's listed neurons, shared by its warps.
    for (int s = warp; s < n_listed; s += TC_WARPS)
        add_neuron_rows_wide<R>(x, w_ud, listed_j[s], listed_mask[s], listed_g + s * R, d, tile, n_tiles, acc, l1,
                                tile_counts);

    if (!last_block_out(ticket)) return;
    finish_rows<NV>(acc, l1, tile_counts, ticket, out, counts, m, d, n_tiles, residual, alpha, sum_normed, eps);
}

#define ROWS_TC_KERNEL(NT, NV, MIN_BLOCKS)                                                                   \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, MIN_BLOCKS)                                 \
        twell_mlp_decode_rows_tc##NT##_bf16_nv##NV(                                                          \
            const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wg,                       \
            const __nv_bfloat16* __restrict__ w_ud, unsigned long long* acc, float* l1, uint32_t* tile_counts, \
            uint32_t* ticket, __nv_bfloat16* __restrict__ out, uint32_t* __restrict__ counts, int m, int d,   \
            int f, int tile, int n_tiles, const __nv_bfloat16* __restrict__ residual,                        \
            const __nv_bfloat16* __restrict__ alpha, __nv_bfloat16* __restrict__ sum_normed, float eps) {    \
        decode_rows_tc<NT, NV>(x, wg, w_ud, acc, l1, tile_counts, ticket, out, counts, m, d, f, tile,        \
                               n_tiles, residual, alpha, sum_normed, eps);                                   \
    }

// Up to 8 rows (one n-tile) and 16 (two), hidden up to 2048, 4096, 8192. Two blocks a
// multiprocessor where the finishing rows fit 128 registers.
ROWS_TC_KERNEL(1, 1, 2)
ROWS_TC_KERNEL(1, 2, 2)
ROWS_TC_KERNEL(1, 4, 1)
ROWS_TC_KERNEL(2, 1, 2)
ROWS_TC_KERNEL(2, 2, 2)
ROWS_TC_KERNEL(2, 4, 1)

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
//   scatters h, dg and du into zeroed dense [M, f] matrices, from which cuBLAS forms
//   the weight gradients (dWg = dGᵀ x, dWu = dUᵀ x, dWd = Hᵀ dout), and writes dg and
//   du of listed slots in slot layout too. g and u of listed slots come from the
//   forward pass; overflowing tiles recompute both (rare).
// * `dx`: dx's row accumulated in registers, reads of Wg_j and Wu_j per active neuron;
//   dg and du come from the slot arrays (one coalesced load per tile, where reading
//   them from the dense matrices scattered a load per slot).
// One fused kernel needed both rows in registers (200+ per thread) and ran at a third
// of the speed for lack of warps in flight.
#include "twell_common.cuh"

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
                          int M, int d, int f, int tile, int cap, int n_tiles) {
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
    // Writes the gradients of active neuron j from its g, u and dout . Wd_j, and
    // returns (dg, du).
    auto store = [&](int j, float g, float u, float dd) {
        const float h = g * u;
        const float sign = (h > 0.f) - (h < 0.f);
        const float dh = dd + dl * sign;
        const __nv_bfloat16 dg = __float2bfloat16(dh * u), du = __float2bfloat16(dh * g);
        h_out[base + j] = __float2bfloat16(h);
        dg_out[base + j] = dg;
        du_out[base + j] = du;
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
                const __nv_bfloat162 both = store(j, g, u, mine);
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
                if (col < width && g > 0.f) store(c0 + col, g, u, dd);
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
        __nv_bfloat16* __restrict__ du_slots, int M, int d, int f, int tile, int cap, int n_tiles) {       \
        grads_row<MAXV>(x, dres, wg, w_ud, counts, indices, g_slots, u_slots, h_out, dg_out, du_out,       \
                        dg_slots, du_slots, M, d, f, tile, cap, n_tiles);                                  \
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

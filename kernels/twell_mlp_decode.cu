// The whole ReGLU MLP for a few token rows (KV-cache decode) in one launch.
//
// A warp takes one neuron j at a time: it reads the gate row Wg_j once for all rows,
// and only where some row's gate is positive does it read Wu_j and Wd_j (the row j of
// the neuron-major w_ud [f, 2d]) and add h_j · Wd_j into f32 sums with atomics. So the
// bytes read are Wg plus the active neurons' rows, and nothing waits between stages.
//
// The sums, the L1 terms and the per-tile counts live in a scratch buffer that the
// host keeps per stream, zeroed. The last block to finish (a ticket counter after a
// fence) turns the sums into the bf16 output rows and the counts into the output
// counts, and zeroes the scratch again for the next launch on the stream.
#include "twell_common.cuh"

// Rows one launch takes (each warp keeps a gate and an up sum per row).
#define DECODE_MAX_ROWS 8

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// sums[r] = x_r . w for the rows r < M, by one warp; the results are in every lane.
__device__ __forceinline__ void warp_dots(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                          int M, int d, float* sums) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < DECODE_MAX_ROWS; ++r) sums[r] = 0.f;
    for (int v = lane; v * VEC < d; v += 32) {
        float wv[VEC];
        load8(w + v * VEC, wv);
#pragma unroll
        for (int r = 0; r < DECODE_MAX_ROWS; ++r) {
            if (r < M) {
                float xv[VEC];
                load8(x + static_cast<long long>(r) * d + v * VEC, xv);
#pragma unroll
                for (int k = 0; k < VEC; ++k) sums[r] = fmaf(xv[k], wv[k], sums[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < DECODE_MAX_ROWS; ++r) sums[r] = warp_sum(sums[r]);
}

extern "C" __global__ void twell_mlp_decode_bf16(
    const __nv_bfloat16* __restrict__ x,     // [M, d]
    const __nv_bfloat16* __restrict__ wg,    // [f, d]
    const __nv_bfloat16* __restrict__ w_ud,  // [f, 2d]: Wu_j then Wd_j
    float* acc,                              // scratch [DECODE_MAX_ROWS, d], zero
    float* l1,                               // scratch [DECODE_MAX_ROWS], zero
    uint32_t* tile_counts,                   // scratch [DECODE_MAX_ROWS, n_tiles], zero
    uint32_t* ticket,                        // scratch, zero
    __nv_bfloat16* __restrict__ out,         // [M, d + L1_COLUMNS]
    uint32_t* __restrict__ counts,           // [M, n_tiles]
    int M, int d, int f, int tile, int n_tiles) {
    const int lane = threadIdx.x & 31;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
    for (long long j = global_warp(); j < f; j += warps) {
        float g[DECODE_MAX_ROWS];
        warp_dots(x, wg + j * d, M, d, g);
        bool any = false;
#pragma unroll
        for (int r = 0; r < DECODE_MAX_ROWS; ++r) {
            // The gate rounds to bf16, as the cuBLAS gate of the other paths does.
            g[r] = r < M ? round_bf16(g[r]) : 0.f;
            any |= g[r] > 0.f;
        }
        if (!any) continue;
        const __nv_bfloat16* row = w_ud + j * 2 * d;
        float h[DECODE_MAX_ROWS];
        warp_dots(x, row, M, d, h);
#pragma unroll
        for (int r = 0; r < DECODE_MAX_ROWS; ++r) h[r] = g[r] > 0.f ? round_bf16(g[r] * h[r]) : 0.f;
        for (int v = lane; v * VEC < d; v += 32) {
            float wv[VEC];
            load8(row + d + v * VEC, wv);
#pragma unroll
            for (int r = 0; r < DECODE_MAX_ROWS; ++r) {
                if (h[r] != 0.f) {
#pragma unroll
                    for (int k = 0; k < VEC; ++k) atomicAdd(acc + r * d + v * VEC + k, h[r] * wv[k]);
                }
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < DECODE_MAX_ROWS; ++r) {
                if (g[r] > 0.f) {
                    atomicAdd(l1 + r, fabsf(h[r]));
                    atomicAdd(tile_counts + r * n_tiles + j / tile, 1u);
                }
            }
        }
    }

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
    const int ld = d + L1_COLUMNS;
    for (int i = threadIdx.x; i < M * ld; i += blockDim.x) {
        const int r = i / ld;
        const int c = i % ld;
        float v = 0.f;
        if (c < d) {
            v = __ldcg(acc + r * d + c);
            acc[r * d + c] = 0.f;
        } else if (c == d) {
            v = __ldcg(l1 + r);
            l1[r] = 0.f;
        }
        out[i] = __float2bfloat16(v);
    }
    for (int i = threadIdx.x; i < M * n_tiles; i += blockDim.x) {
        counts[i] = __ldcg(tile_counts + i);
        tile_counts[i] = 0u;
    }
    if (threadIdx.x == 0) *ticket = 0u;
}

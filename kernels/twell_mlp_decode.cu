// The whole ReGLU MLP of one token row (KV-cache decode) in one launch.
//
// The row of x sits in every warp's registers. A warp takes one neuron j at a time: it
// reads the gate row Wg_j (all its 16-byte loads in flight at once), and only where the
// gate is positive does it read Wu_j and Wd_j (row j of the neuron-major w_ud [f, 2d])
// and add h_j · Wd_j into f32 sums with atomics. So the bytes read are Wg plus the
// active neurons' rows, and nothing waits between stages.
//
// The sums, the L1 term and the per-tile counts live in a scratch buffer that the host
// keeps per stream, zeroed. The last block to finish (a ticket counter after a fence)
// turns the sums into the bf16 output row and the counts into the output counts, and
// zeroes the scratch again for the next launch on the stream.
#include "twell_common.cuh"

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

template <int MAXV>
__device__ void decode_row(const __nv_bfloat16* __restrict__ x,     // [1, d]
                           const __nv_bfloat16* __restrict__ wg,    // [f, d]
                           const __nv_bfloat16* __restrict__ w_ud,  // [f, 2d]: Wu_j then Wd_j
                           float* acc,                              // scratch [d], zero
                           float* l1,                               // scratch [1], zero
                           uint32_t* tile_counts,                   // scratch [n_tiles], zero
                           uint32_t* ticket,                        // scratch, zero
                           __nv_bfloat16* __restrict__ out,         // [1, d + L1_COLUMNS]
                           uint32_t* __restrict__ counts,           // [1, n_tiles]
                           int d, int f, int tile, int n_tiles) {
    const int lane = threadIdx.x & 31;
    uint4 xr[MAXV];
    row_to_registers<MAXV>(x, d, xr);
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
    for (long long j = global_warp(); j < f; j += warps) {
        // The gate rounds to bf16, as the cuBLAS gate of the other paths does.
        const float g = round_bf16(registers_dot<MAXV>(xr, wg + j * d, d));
        if (g <= 0.f) continue;  // the same in every lane
        const __nv_bfloat16* row = w_ud + j * 2 * d;
        const float h = round_bf16(g * registers_dot<MAXV>(xr, row, d));
        uint4 wd[MAXV];
        row_to_registers<MAXV>(row + d, d, wd);  // all loads in flight before the atomics
#pragma unroll
        for (int i = 0; i < MAXV; ++i) {
            const int e = (lane + 32 * i) * VEC;
            if (e < d) {
                const __nv_bfloat162* wh = reinterpret_cast<const __nv_bfloat162*>(&wd[i]);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float2 wf = __bfloat1622float2(wh[q]);
                    atomicAdd(acc + e + 2 * q, h * wf.x);
                    atomicAdd(acc + e + 2 * q + 1, h * wf.y);
                }
            }
        }
        if (lane == 0) {
            atomicAdd(l1, fabsf(h));
            atomicAdd(tile_counts + j / tile, 1u);
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
    for (int c = threadIdx.x; c < d + L1_COLUMNS; c += blockDim.x) {
        float v = 0.f;
        if (c < d) {
            v = __ldcg(acc + c);
            acc[c] = 0.f;
        } else if (c == d) {
            v = __ldcg(l1);
            *l1 = 0.f;
        }
        out[c] = __float2bfloat16(v);
    }
    for (int t = threadIdx.x; t < n_tiles; t += blockDim.x) {
        counts[t] = __ldcg(tile_counts + t);
        tile_counts[t] = 0u;
    }
    if (threadIdx.x == 0) *ticket = 0u;
}

#define DECODE_KERNEL(MAXV)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) twell_mlp_decode_bf16_v##MAXV(                 \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wg,                   \
        const __nv_bfloat16* __restrict__ w_ud, float* acc, float* l1, uint32_t* tile_counts,         \
        uint32_t* ticket, __nv_bfloat16* __restrict__ out, uint32_t* __restrict__ counts, int d,      \
        int f, int tile, int n_tiles) {                                                               \
        decode_row<MAXV>(x, wg, w_ud, acc, l1, tile_counts, ticket, out, counts, d, f, tile, n_tiles); \
    }

DECODE_KERNEL(1)
DECODE_KERNEL(2)
DECODE_KERNEL(4)
DECODE_KERNEL(8)
DECODE_KERNEL(16)

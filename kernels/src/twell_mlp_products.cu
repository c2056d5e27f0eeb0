// twell_mlp_products: the middle of the MLP when its three projections run as cuBLAS
// GEMMs, for inference at densities where a tile of tokens needs nearly every neuron
// (uniform 3%: a 64-token tile needs 86% of them, docs/design.md), so that
// skipping inactive neurons saves less than tensor cores gain over per-pair dot products.
//
// One warp per row reads the gate g and the up projection u ([M, f] bf16 each, from
// cuBLAS) and writes h = relu(g) * u over u, for the down GEMM to read. On the way it
// counts each tile's positive gates, as the TwELL pack would (the caller's density and
// overflow figures read them), and stores the row's L1 term Σ|h| after the output rows,
// where the other MLP paths put it. h is rounded to bf16 as the row kernels round it.
#include "common.cuh"

// 256 columns a step (32 lanes x 8); a lane issues the loads of this many steps before
// it uses any, so that more than one 16-byte load per lane is in flight.
#define PRODUCT_STEPS 4

// h = relu(g) * u for the 8 columns of one 16-byte vector; returns how many gates are
// positive and adds Σ|h| into l1.
__device__ __forceinline__ int product8(const uint4& graw, uint4& uraw, float& l1) {
    float g[8], u[8];
    const __nv_bfloat162* gh = reinterpret_cast<const __nv_bfloat162*>(&graw);
    __nv_bfloat162* uh = reinterpret_cast<__nv_bfloat162*>(&uraw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 gf = __bfloat1622float2(gh[k]);
        const float2 uf = __bfloat1622float2(uh[k]);
        g[2 * k] = gf.x;
        g[2 * k + 1] = gf.y;
        u[2 * k] = uf.x;
        u[2 * k + 1] = uf.y;
    }
    int positive = 0;
    float h[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const bool on = g[k] > 0.f;
        positive += on;
        h[k] = on ? round_bf16(g[k] * u[k]) : 0.f;
        l1 += fabsf(h[k]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) uh[k] = __floats2bfloat162_rn(h[2 * k], h[2 * k + 1]);
    return positive;
}

// Each tile's count, from every lane's count of positives in its 8 columns: the lanes
// of one tile (tile / 8 of them, a power of two) add theirs, and the first one stores.
__device__ __forceinline__ void store_tile_counts(int positive, long long col, int f, int tile,
                                                  uint32_t* row_counts) {
    const int lanes_per_tile = tile / VEC;
    for (int o = lanes_per_tile / 2; o > 0; o >>= 1) positive += __shfl_xor_sync(FULL_MASK, positive, o);
    const int lane = threadIdx.x & 31;
    if (col < f && lane % lanes_per_tile == 0) row_counts[col / tile] = static_cast<uint32_t>(positive);
}

// Needs f % 8 == 0 (16-byte aligned rows) and tile a power of two from 8 to 256 (a
// step of 256 columns holds whole tiles); the host checks both.
extern "C" __global__ void twell_mlp_products_bf16(
    const __nv_bfloat16* __restrict__ gate,  // [M, f]
    __nv_bfloat16* __restrict__ up,          // [M, f]: u in, h out
    uint32_t* __restrict__ counts,           // [M, n_tiles]
    __nv_bfloat16* __restrict__ out,         // [M, d] rows, then the M L1 terms (written here)
    int M, int d, int f, int tile, int n_tiles) {
    const long long row = global_warp();
    if (row >= M) return;
    const int lane = threadIdx.x & 31;
    const __nv_bfloat16* g = gate + row * f;
    __nv_bfloat16* u = up + row * f;
    uint32_t* row_counts = counts + row * n_tiles;
    float l1 = 0.f;
    const int lane_col = lane * VEC;
    for (int base = 0; base < f; base += PRODUCT_STEPS * WARP_CHUNK) {
        uint4 graw[PRODUCT_STEPS], uraw[PRODUCT_STEPS];
#pragma unroll
        for (int s = 0; s < PRODUCT_STEPS; ++s) {
            const int col = base + s * WARP_CHUNK + lane_col;
            if (col < f) {
                graw[s] = *reinterpret_cast<const uint4*>(g + col);
                uraw[s] = *reinterpret_cast<const uint4*>(u + col);
            }
        }
#pragma unroll
        for (int s = 0; s < PRODUCT_STEPS; ++s) {
            const int step = base + s * WARP_CHUNK;
            if (step >= f) break;  // the same for every lane: the shuffles stay whole
            const int col = step + lane_col;
            int positive = 0;
            if (col < f) {
                positive = product8(graw[s], uraw[s], l1);
                *reinterpret_cast<uint4*>(u + col) = uraw[s];
            }
            store_tile_counts(positive, col, f, tile, row_counts);
        }
    }
    l1 = warp_sum(l1);
    if (lane == 0) out[l1_at(M, d, row)] = __float2bfloat16(l1);
}

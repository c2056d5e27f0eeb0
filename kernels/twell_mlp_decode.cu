// The whole ReGLU MLP of one token row (KV-cache decode) in one launch.
//
// The row of x sits in every warp's registers. The kernel runs in two phases, so that no
// warp waits on more than one memory round trip per step:
// 1. gates: a warp takes two neurons at a time and reads both gate rows Wg_j at once (all
//    their 16-byte loads in flight); each neuron whose gate is positive goes on its
//    block's list in shared memory;
// 2. the block's warps share its list: a warp reads a listed neuron's Wu_j and Wd_j (row
//    j of the neuron-major w_ud [f, 2d]) together, and adds h_j · Wd_j into f32 sums with
//    atomics, lanes on neighbouring floats so each atomic instruction covers 256 bytes.
// So the bytes read are Wg plus the active neurons' rows. A block whose list is full adds
// the neuron at once instead, so none is ever dropped.
//
// The sums, the L1 term and the per-tile counts live in a scratch buffer that the host
// keeps per stream, zeroed. The last block to finish (a ticket counter after a fence)
// turns the sums into the bf16 output row and the counts into the output counts, and
// zeroes the scratch again for the next launch on the stream. Given a residual row, it
// also writes the residual add and the next sublayer's RMS norm of it.
#include "twell_common.cuh"

// Active neurons one block lists between the phases (at 3% density a block holds 1-2).
#define DECODE_LIST 128
// The fused residual add + norm: the block size and the row's 16-byte vectors per
// thread of `add_rms_norm.cu` (NORM_THREADS, NORM_MAX_VECS), so it rounds the same way.
#define ADD_NORM_THREADS 256
#define ADD_NORM_MAX_VECS 4

// x . w0 and x . w1 with both rows' loads in flight at once (w1 may be null: 0).
template <int MAXV>
__device__ __forceinline__ void registers_dot2(const uint4* r, const __nv_bfloat16* __restrict__ w0,
                                               const __nv_bfloat16* __restrict__ w1, int d, float& s0,
                                               float& s1) {
    uint4 a[MAXV], b[MAXV];
    row_to_registers<MAXV>(w0, d, a);
    if (w1 != nullptr) {
        row_to_registers<MAXV>(w1, d, b);
    } else {
#pragma unroll
        for (int i = 0; i < MAXV; ++i) b[i] = make_uint4(0u, 0u, 0u, 0u);
    }
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
                                           float g, int d, int tile, float* acc, float* l1,
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
            atomicAdd(acc + e, h * wf.x);
            atomicAdd(acc + e + 1, h * wf.y);
        }
    }
    if (lane == 0) {
        atomicAdd(l1, fabsf(h));
        atomicAdd(tile_counts + j / tile, 1u);
    }
}

template <int MAXV>
__device__ void decode_row(const __nv_bfloat16* __restrict__ x,     // [1, d]
                           const __nv_bfloat16* __restrict__ wg,    // [f, d]
                           const __nv_bfloat16* __restrict__ w_ud,  // [f, 2d]: Wu_j then Wd_j
                           float* acc,                              // scratch [d], zero
                           float* l1,                               // scratch [1], zero
                           uint32_t* tile_counts,                   // scratch [n_tiles], zero
                           uint32_t* ticket,                        // scratch, zero
                           __nv_bfloat16* __restrict__ out,         // [1, d], then the L1 term
                           uint32_t* __restrict__ counts,           // [1, n_tiles]
                           int d, int f, int tile, int n_tiles,
                           const __nv_bfloat16* __restrict__ residual,  // [1, d], or null
                           const __nv_bfloat16* __restrict__ alpha,     // [d] norm weight
                           __nv_bfloat16* __restrict__ sum_normed,      // [2, d]
                           float eps) {
    __shared__ int listed_j[DECODE_LIST];
    __shared__ float listed_g[DECODE_LIST];
    __shared__ int n_listed;
    if (threadIdx.x == 0) n_listed = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    uint4 xr[MAXV];
    row_to_registers<MAXV>(x, d, xr);

    // Phase 1: the gates, two neurons per warp-step.
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x >> 5);
    for (long long j = global_warp(); j < f; j += 2 * warps) {
        const long long j2 = j + warps;
        float g[2];
        registers_dot2<MAXV>(xr, wg + j * d, j2 < f ? wg + j2 * d : nullptr, d, g[0], g[1]);
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
                add_neuron<MAXV>(xr, w_ud, jk, gk, d, tile, acc, l1, tile_counts);
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
    // Four sums per thread and step (d % 8 == 0): this block runs alone, so its few
    // round trips to L2 are the kernel's tail.
#pragma unroll 2
    for (int c = 4 * threadIdx.x; c < d; c += 4 * blockDim.x) {
        const float4 a = __ldcg(reinterpret_cast<const float4*>(acc + c));
        *reinterpret_cast<float4*>(acc + c) = make_float4(0.f, 0.f, 0.f, 0.f);
        __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + c);
        o[0] = __floats2bfloat162_rn(a.x, a.y);
        o[1] = __floats2bfloat162_rn(a.z, a.w);
    }
    if (threadIdx.x == 0) {
        out[l1_at(1, d, 0)] = __float2bfloat16(__ldcg(l1));
        *l1 = 0.f;
    }
    for (int t = threadIdx.x; t < n_tiles; t += blockDim.x) {
        counts[t] = __ldcg(tile_counts + t);
        tile_counts[t] = 0u;
    }
    if (threadIdx.x == 0) *ticket = 0u;
    if (residual == nullptr) return;
    // The residual add and the next sublayer's RMS norm (`add_rms_norm.cu` with x the
    // residual and y this row, the same partition of the row over 256 threads and the
    // same order of operations, so the same bits): one launch fewer per layer.
    __syncthreads();  // this block's writes of `out`, read back below
    const int vecs = d / VEC;
    float sums[ADD_NORM_MAX_VECS][VEC];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < ADD_NORM_MAX_VECS; ++i) {
        const int v = threadIdx.x + i * ADD_NORM_THREADS;
        if (v < vecs) {
            float a[VEC], b[VEC];
            load8(residual + v * VEC, a);
            load8(out + v * VEC, b);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                sums[i][k] = round_bf16(a[k] + b[k]);
                ss = fmaf(sums[i][k], sums[i][k], ss);
            }
            store8(sum_normed + v * VEC, sums[i]);
        }
    }
    __shared__ float partial[ADD_NORM_THREADS / 32];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < ADD_NORM_THREADS / 32; ++w) total += partial[w];
    const float scale = rsqrtf(total / d + eps);
#pragma unroll
    for (int i = 0; i < ADD_NORM_MAX_VECS; ++i) {
        const int v = threadIdx.x + i * ADD_NORM_THREADS;
        if (v < vecs) {
            float a[VEC], o[VEC];
            load8(alpha + v * VEC, a);
#pragma unroll
            for (int k = 0; k < VEC; ++k) o[k] = scale * sums[i][k] * a[k];
            store8(sum_normed + d + v * VEC, o);
        }
    }
}

// Two blocks per multiprocessor where the row fits 128 registers a thread (up to d = 2048):
// twice the loads in flight. At d = 4096 that bound would spill the rows, so one block.
#define DECODE_KERNEL(MAXV, MIN_BLOCKS)                                                              \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) twell_mlp_decode_bf16_v##MAXV(     \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ wg,                   \
        const __nv_bfloat16* __restrict__ w_ud, float* acc, float* l1, uint32_t* tile_counts,         \
        uint32_t* ticket, __nv_bfloat16* __restrict__ out, uint32_t* __restrict__ counts, int d,      \
        int f, int tile, int n_tiles, const __nv_bfloat16* __restrict__ residual,                    \
        const __nv_bfloat16* __restrict__ alpha, __nv_bfloat16* __restrict__ sum_normed, float eps) { \
        decode_row<MAXV>(x, wg, w_ud, acc, l1, tile_counts, ticket, out, counts, d, f, tile, n_tiles,  \
                         residual, alpha, sum_normed, eps);                                           \
    }

DECODE_KERNEL(1, 2)
DECODE_KERNEL(2, 2)
DECODE_KERNEL(4, 2)
DECODE_KERNEL(8, 2)
DECODE_KERNEL(16, 1)

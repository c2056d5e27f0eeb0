// y = x · Wᵀ for a few rows of x (a decode step: one row a sequence), bf16 in and out,
// f32 sums.
//
// At 1–8 rows a projection is bound by reading W once: 25 MB for the stacked q, k, v of a
// 1.5B model. A warp takes R rows of W and issues every 16-byte load of a K-chunk of them
// at once (U vectors a lane and row), then multiplies each by the M rows of x, which L1
// serves to all warps of a block. So each weight byte is read once, in one round trip per
// chunk, with nothing staged: the kernel is one pass over W.
#include "common.cuh"

#define LINEAR_ROWS_THREADS 256
#define LINEAR_ROWS_WARPS (LINEAR_ROWS_THREADS / 32)
// Rows of W a warp takes at once.
#define LINEAR_ROWS_R 2

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

// M: rows of x the kernel is built for (m ≤ M, the rest skipped); U: 16-byte vectors a
// lane loads per row and chunk (a chunk is 256·U columns).
template <int M, int U>
__device__ void linear_rows(const __nv_bfloat16* __restrict__ x,  // [m, k]
                            const __nv_bfloat16* __restrict__ w,  // [n, k]
                            __nv_bfloat16* __restrict__ y,        // [m, n]
                            int m, int n, int k) {
    const int lane = threadIdx.x & 31;
    const long long first = (static_cast<long long>(blockIdx.x) * LINEAR_ROWS_WARPS + (threadIdx.x >> 5)) *
                            LINEAR_ROWS_R;
    if (first >= n) return;
    float acc[LINEAR_ROWS_R][M];
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS_R; ++r)
#pragma unroll
        for (int i = 0; i < M; ++i) acc[r][i] = 0.f;
    const int vecs = k / VEC;
    for (int base = 0; base < vecs; base += 32 * U) {
        uint4 wv[LINEAR_ROWS_R][U];
        // Every load of the chunk first, so they are all in flight together.
#pragma unroll
        for (int r = 0; r < LINEAR_ROWS_R; ++r) {
            const long long row = first + r;
            const uint4* wr = reinterpret_cast<const uint4*>(w + row * k);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int v = base + lane + 32 * u;
                wv[r][u] = (row < n && v < vecs) ? __ldcs(wr + v) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = base + lane + 32 * u;
            if (v >= vecs) break;
#pragma unroll
            for (int i = 0; i < M; ++i) {
                if (i >= m) break;
                const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + static_cast<long long>(i) * k) + v);
#pragma unroll
                for (int r = 0; r < LINEAR_ROWS_R; ++r) acc[r][i] = dot8_acc(wv[r][u], xv, acc[r][i]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS_R; ++r) {
        const long long row = first + r;
#pragma unroll
        for (int i = 0; i < M; ++i) {
            const float s = warp_sum(acc[r][i]);
            if (lane == 0 && i < m && row < n) y[static_cast<long long>(i) * n + row] = __float2bfloat16(s);
        }
    }
}

#define LINEAR_ROWS_KERNEL(M, U)                                                                          \
    extern "C" __global__ void __launch_bounds__(LINEAR_ROWS_THREADS) linear_rows_bf16_m##M##_u##U(      \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,                          \
        __nv_bfloat16* __restrict__ y, int m, int n, int k) {                                              \
        linear_rows<M, U>(x, w, y, m, n, k);                                                               \
    }
#define LINEAR_ROWS_KERNELS(M) LINEAR_ROWS_KERNEL(M, 2) LINEAR_ROWS_KERNEL(M, 4) LINEAR_ROWS_KERNEL(M, 8)

LINEAR_ROWS_KERNELS(1)
LINEAR_ROWS_KERNELS(2)
LINEAR_ROWS_KERNELS(4)
LINEAR_ROWS_KERNELS(8)

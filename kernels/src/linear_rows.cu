// y = x · Wᵀ for a few rows of x (a decode step: one row a sequence), bf16 in and out,
// f32 sums.
//
// At 1–8 rows a projection is bound by reading W once: 25 MB for the stacked q, k, v of a
// 1.5B model. Each warp streams rows of W in 16-byte loads (U vectors a lane per chunk of
// a row) and multiplies them by the M rows of x, which L1 serves to all warps of a block:
// each weight byte is read once, with nothing staged.
#include "common.cuh"

#define LINEAR_ROWS_THREADS 256
#define LINEAR_ROWS_WARPS (LINEAR_ROWS_THREADS / 32)

// U 16-byte vectors a lane of chunk c of row r of w (zeros past the row or past n).
template <int U>
__device__ __forceinline__ void load_chunk(const __nv_bfloat16* __restrict__ w, long long r, int c, int n,
                                           int k, uint4 (&buf)[U]) {
    const int lane = threadIdx.x & 31, vecs = k / VEC;
    const uint4* wr = reinterpret_cast<const uint4*>(w + r * k);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int v = c * 32 * U + lane + 32 * u;
        buf[u] = (r < n && v < vecs) ? __ldcs(wr + v) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// M: rows of x the kernel is built for (m ≤ M, the rest skipped); U: 16-byte vectors a
// lane loads per chunk (a chunk is 256·U columns of a row). The grid is at most one wave:
// a warp walks rows warp, warp + warps, ... chunk by chunk, and the loads of its next
// chunk are in flight while it multiplies the current one, so each warp streams W
// without a gap and no second wave of blocks waits behind a tail.
template <int M, int U>
__device__ void linear_rows(const __nv_bfloat16* __restrict__ x,  // [m, k]
                            const __nv_bfloat16* __restrict__ w,  // [n, k]
                            __nv_bfloat16* __restrict__ y,        // [m, n]
                            int m, int n, int k) {
    const int lane = threadIdx.x & 31, vecs = k / VEC;
    const int chunks = (vecs + 32 * U - 1) / (32 * U);
    const long long warps = static_cast<long long>(gridDim.x) * LINEAR_ROWS_WARPS;
    long long r = global_warp();
    if (r >= n) return;
    int c = 0;
    uint4 cur[U], next[U];
    load_chunk<U>(w, r, 0, n, k, cur);
    float acc[M];
#pragma unroll
    for (int i = 0; i < M; ++i) acc[i] = 0.f;
    while (true) {
        long long nr = r;
        int nc = c + 1;
        if (nc == chunks) {
            nr = r + warps;
            nc = 0;
        }
        load_chunk<U>(w, nr, nc, n, k, next);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = c * 32 * U + lane + 32 * u;
            if (v >= vecs) break;
#pragma unroll
            for (int i = 0; i < M; ++i) {
                if (i >= m) break;
                const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + static_cast<long long>(i) * k) + v);
                acc[i] = dot8_acc(cur[u], xv, acc[i]);
            }
        }
        if (c == chunks - 1) {
#pragma unroll
            for (int i = 0; i < M; ++i) {
                const float s = warp_sum(acc[i]);
                if (lane == 0 && i < m) y[static_cast<long long>(i) * n + r] = __float2bfloat16(s);
                acc[i] = 0.f;
            }
        }
        if (nr >= n) break;
        r = nr;
        c = nc;
#pragma unroll
        for (int u = 0; u < U; ++u) cur[u] = next[u];
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

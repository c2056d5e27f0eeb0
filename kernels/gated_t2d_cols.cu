// gated_t2d_cols: the sparse down projection with the weights held on chip.
//
//   out_i = sum_j h_ij * Wd_j, and the L1 term after the rows, as `gated_t2d`'s down
//   kernels store them, from the h that `gated_t2d`'s up kernel leaves in the TwELL slots.
//
// Why: the row kernels read each active pair's Wd row (2d bytes) from L2, ~8 TB/s on the
// H200, and that read is their whole cost at 0.5-3% density. Split by output columns,
// the whole Wd fits the card's shared memory (5632 neurons x 16 columns x 2 bytes =
// 176 KB a block, 128 blocks for d = 2048), and shared memory's aggregate bandwidth is
// several times L2's. Each block then streams every token's (neuron, h) list past its
// slice: a thread per token, the token's C output columns in registers, one 16-byte
// shared load per 8 columns and active neuron. No reduction between blocks: a block
// owns its columns.
//
// Two launches:
//   list: a warp per token packs its h into one list of u32 entries (neuron | bf16 h
//         << 16; the lists of 32 tokens interleaved, `list_base`), in tile and slot order (an overflowing tile's nonzeros read from the
//         dense h), padded with zero entries to a multiple of 4; the list length, or
//         more than `stride` when the token's entries outgrow the list, whose token the
//         down kernel then reads from the TwELL slots itself (nothing is lost).
//   down: grid (d / C column blocks, token groups); each block loads its Wd slice once.
// The sums run in the row kernels' order (tile, slot, fmaf per column), so the output is
// the same to the bit.
#include "twell_common.cuh"

__device__ __forceinline__ uint32_t list_entry(int j, float h) {
    return static_cast<uint32_t>(j) | (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(h))) << 16);
}

// The lists of 32 consecutive tokens are interleaved by 16-byte groups: entries 4g .. 4g + 3
// of the block's k-th token sit at group g, place k. The down kernel's warp (32
// consecutive tokens, a thread each) then reads one 512-byte run for its next four
// entries each, instead of 32 scattered 16-byte pieces (which kept its L1 busy).
__device__ __forceinline__ long long list_base(long long row, int stride) {
    return (row >> 5) * 32LL * stride + (row & 31) * 4;
}
__device__ __forceinline__ int list_offset(int i) { return (i >> 2) * 128 + (i & 3); }

extern "C" __global__ void __launch_bounds__(256) gated_t2d_cols_list_bf16(
    const uint32_t* __restrict__ counts,       // [M, n_tiles]
    const uint8_t* __restrict__ indices,       // [M, n_tiles, cap]
    const __nv_bfloat16* __restrict__ values,  // [M, n_tiles, cap]: h
    const __nv_bfloat16* __restrict__ gate,    // [M, f]: h of overflow tiles
    uint32_t* __restrict__ list,               // [M, stride]
    uint32_t* __restrict__ list_len,           // [M]
    int M, int f, int tile, int cap, int n_tiles, int stride) {
    const long long row = global_warp();
    if (row >= M) return;
    const int lane = threadIdx.x & 31;
    uint32_t* base = list + list_base(row, stride);
    auto at = [&](int i) { return base + list_offset(i); };
    int n = 0;  // entries so far, the same in every lane
    walk_row(
        counts, indices, values, row, tile, cap, n_tiles, f,
        [&](int j, float h, long long, int count) {
            if (lane < count && n + lane < stride) *at(n + lane) = list_entry(j, h);
            n += count;
        },
        [&](int c0, int width) {
            each_dense_nonzero(gate + row * f + c0, width, [&](int c, float h) {
                if (lane == 0 && n < stride) *at(n) = list_entry(c0 + c, h);
                n += 1;
            });
        });
    // Zero entries (neuron 0, h 0) up to a multiple of 4: the down kernel reads 16 bytes.
    const int padded = min((n + 3) & ~3, stride);
    if (n + lane < padded) *at(n + lane) = 0u;
    if (lane == 0) list_len[row] = static_cast<uint32_t>(n);
}

// The slice's 16-byte vector p of neuron j: with two vectors a neuron, rows j and j + 4
// swap theirs, so the first vectors of random neurons spread over all eight 16-byte bank
// groups instead of four.
template <int V>
__device__ __forceinline__ int slice_at(int j, int p) {
    return j * V + (V == 2 ? (p ^ ((j >> 2) & 1)) : p);
}

// acc[0..8) += h * the 8 bf16 of w.
__device__ __forceinline__ void axpy8_raw(float h, const uint4& w, float* acc) {
    const uint32_t q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        acc[2 * k] = fmaf(h, __uint_as_float(q[k] << 16), acc[2 * k]);
        acc[2 * k + 1] = fmaf(h, __uint_as_float(q[k] & 0xffff0000u), acc[2 * k + 1]);
    }
}

// C output columns a block (V = C / 8 vectors a neuron); dynamic shared memory f * C * 2
// bytes.
template <int C>
__device__ void down_cols(const __nv_bfloat16* __restrict__ w_ud, const uint32_t* __restrict__ list,
                          const uint32_t* __restrict__ list_len, const uint32_t* __restrict__ counts,
                          const uint8_t* __restrict__ indices, const __nv_bfloat16* __restrict__ values,
                          const __nv_bfloat16* __restrict__ gate, const float* __restrict__ l1,
                          __nv_bfloat16* __restrict__ out, int M, int d, int f, int tile, int cap, int n_tiles,
                          int stride) {
    constexpr int V = C / VEC;
    extern __shared__ uint4 slice[];
    const int c0 = blockIdx.x * C;
    const long long two_d = 2LL * d;
    for (int i = threadIdx.x; i < f * V; i += blockDim.x) {
        const int j = i / V, p = i % V;
        slice[slice_at<V>(j, p)] = *reinterpret_cast<const uint4*>(w_ud + j * two_d + d + c0 + p * VEC);
    }
    __syncthreads();
    const long long step = static_cast<long long>(gridDim.y) * blockDim.x;
    for (long long r = static_cast<long long>(blockIdx.y) * blockDim.x + threadIdx.x; r < M; r += step) {
        float acc[C];
#pragma unroll
        for (int k = 0; k < C; ++k) acc[k] = 0.f;
        auto add = [&](int j, float h) {
#pragma unroll
            for (int p = 0; p < V; ++p) axpy8_raw(h, slice[slice_at<V>(j, p)], acc + p * VEC);
        };
        const uint32_t n = list_len[r];
        if (n <= static_cast<uint32_t>(stride)) {
            const uint4* e = reinterpret_cast<const uint4*>(list + list_base(r, stride));
            // The next four entries load while these four are summed.
            uint4 next = n > 0 ? e[0] : make_uint4(0u, 0u, 0u, 0u);
            for (uint32_t i = 0; i < n; i += 4) {
                const uint4 q = next;
                if (i + 4 < n) next = e[((i >> 2) + 1) * 32];
                add(q.x & 0xffffu, __uint_as_float(q.x & 0xffff0000u));
                add(q.y & 0xffffu, __uint_as_float(q.y & 0xffff0000u));
                add(q.z & 0xffffu, __uint_as_float(q.z & 0xffff0000u));
                add(q.w & 0xffffu, __uint_as_float(q.w & 0xffff0000u));
            }
        } else {
            // The list overflowed: the token's slots and dense tiles, in the same order.
            for (int t = 0; t < n_tiles; ++t) {
                const long long rt = r * n_tiles + t;
                const int count = static_cast<int>(counts[rt]);
                const int base = t * tile;
                if (count <= cap) {
                    for (int s = 0; s < count; ++s)
                        add(base + indices[rt * cap + s], __bfloat162float(values[rt * cap + s]));
                } else {
                    const int width = min(tile, f - base);
                    for (int c = 0; c < width; ++c) {
                        const float h = __bfloat162float(gate[r * f + base + c]);
                        if (h != 0.f) add(base + c, h);
                    }
                }
            }
        }
#pragma unroll
        for (int p = 0; p < V; ++p) store8(out + r * d + c0 + p * VEC, acc + p * VEC);
        if (blockIdx.x == 0) out[l1_at(M, d, r)] = __float2bfloat16(l1[r]);
    }
}

#define DOWN_COLS_KERNEL(C)                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) gated_t2d_cols_down_bf16_c##C(                     \
        const __nv_bfloat16* __restrict__ w_ud, const uint32_t* __restrict__ list,                        \
        const uint32_t* __restrict__ list_len, const uint32_t* __restrict__ counts,                       \
        const uint8_t* __restrict__ indices, const __nv_bfloat16* __restrict__ values,                    \
        const __nv_bfloat16* __restrict__ gate, const float* __restrict__ l1, __nv_bfloat16* __restrict__ out, \
        int M, int d, int f, int tile, int cap, int n_tiles, int stride) {                                \
        down_cols<C>(w_ud, list, list_len, counts, indices, values, gate, l1, out, M, d, f, tile, cap, n_tiles, \
                     stride);                                                                             \
    }
DOWN_COLS_KERNEL(8)
DOWN_COLS_KERNEL(16)

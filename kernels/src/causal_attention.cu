// causal_attention: softmax(q kᵀ / sqrt(hd) + causal mask) v in one pass, for prefill.
//
// The plain-op attention materialises the [b, heads, t, T] f32 scores and runs a dozen
// elementwise kernels over them; at 4 x 2048 tokens that is 24 ms a layer on an H200.
// Here the scores never leave registers (online softmax, as in FlashAttention), and both
// products run on tensor cores (mma.sync m16n8k16, bf16 in, f32 sums; sm_80 and later):
// a block of ATT_WARPS warps takes ATT_QUERIES queries, 32 per warp, and walks the keys
// in tiles of ATT_KEYS, copied into shared memory with cp.async in two stages so the next
// tile loads while this one is computed. A warp's scores S = Q Kᵀ come out of the mma in
// the very register layout the next mma wants for P, so P V needs no shuffle; K's and
// V's fragments come from shared memory through ldmatrix (V transposed).
//
// Query i sits at absolute position past + i and attends keys 0 ..= past + i (past = T - t:
// the KV cache before this call). Grouped-query attention: head h reads KV head
// h / (heads / kv_heads). bf16 in and out.
//
// Layouts: q, k, v are read through strides (batch, head, position; the head dims
// contiguous, every row 16-byte aligned), so the model hands over its [b, t, heads, hd]
// projections and its KV cache as they are, without a transposing copy. The output is
// written [b, t, heads, hd], which is what the output projection reads.
// The prefill kernels can also take q unturned, as the fused q | k | v projection gives
// it, with its RoPE angles (`q_angles`, [t, hd]: each query row's cos, then its sin) and
// turn it while staging it: the rope pass over q (read and written once more) goes.
//
// Built twice: for compute_80 (every card) and for sm_90a, where a second kernel does both
// products with wgmma (Hopper's warpgroup instructions, below); the launcher picks it on a
// compute capability 9.0 card.
//
// One query per (batch, head) (KV-cache decode) would leave 15 of a warp's 16 rows idle,
// so it has its own kernel below: a block per (batch, head) spreads the keys over its
// threads.
#include "common.cuh"
#include "mma_sync.cuh"

#define ATT_WARPS 4
// Query tiles of 16 per warp: each K and V fragment feeds ATT_MTILES mma, and their
// softmax chains are independent.
#define ATT_MTILES 2
#define ATT_QUERIES (16 * ATT_MTILES * ATT_WARPS)
#define ATT_KEYS 64
// Warps of the wgmma kernel (two warpgroups), 16 queries each.
#define ATT_WGMMA_WARPS 8
// exp(x) = exp2(x · log2 e): the scale folds it in once.
#define LOG2_E 1.4426950408889634f

// Element strides of a [b, heads, positions, hd] operand: batch, head, position.
struct Strides {
    long long b, h, t;
    __device__ __forceinline__ long long row(int bi, int hi, int ti) const {
        return bi * b + hi * h + static_cast<long long>(ti) * t;
    }
};

// Offset of (batch, head, position) in the [b, t, heads, hd] output.
__device__ __forceinline__ long long out_row(int bi, int hi, int ti, int heads, int t, int hd) {
    return ((static_cast<long long>(bi) * t + ti) * heads + hi) * hd;
}

// 2^x on the special-function unit (2^-inf = 0).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two floats as one bf16 pair, the first in the low half (the lower column of a fragment).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t load_pair(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// A query's bf16 pair of dims i, i + 1 (< hd/2) and its RoPE partner pair (dims i + hd/2,
// i + hd/2 + 1), turned by the angles at `cs` (the cos of dim i; its sin hd/2 further),
// each rounded once to bf16 as rope.cu rounds them.
__device__ __forceinline__ void turn_pair(uint32_t& x1, uint32_t& x2, const __nv_bfloat16* cs, int half) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x1));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x2));
    const float2 co = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(cs));
    const float2 sn = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(cs + half));
    float o1x, o1y, o2x, o2y;
    rope_turn(a.x, b.x, co.x, sn.x, o1x, o2x);
    rope_turn(a.y, b.y, co.y, sn.y, o1y, o2y);
    x1 = pack_bf16(o1x, o1y);
    x2 = pack_bf16(o2x, o2y);
}

// One key tile's online softmax for a warp's MT query tiles of 16 (rows pos[mt][0] and
// pos[mt][1] of this lane): masks the keys past each row where the tile crosses the
// diagonal of the warp's first row, moves the running maxima m (rescaling the sums l and
// the accumulators o where one moved) and leaves P = exp(s - m) in bf16 in `pa`, whose
// k-step kk holds key tiles 2kk and 2kk + 1: the A fragments of O += P V.
// The scores stay unscaled (the scale is positive, so the maxima are the same keys'):
// the scale goes into the exponent's one fused multiply-add. The MT tiles go through each
// step together, in one basic block where they can, so their independent chains
// interleave.
template <int MT, int DIM_TILES>
__device__ __forceinline__ void softmax_tile(float (&s)[MT][ATT_KEYS / 8][4], float (&m)[MT][2], float (&l)[MT][2],
                                             float (&o)[MT][DIM_TILES][4], uint32_t (&pa)[MT][ATT_KEYS / 16][4],
                                             const int (&pos)[MT][2], int k0, int c, float scale_log2) {
    constexpr int KEY_TILES = ATT_KEYS / 8;
    if (k0 + ATT_KEYS - 1 > pos[0][0]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + n * 8 + 2 * c + (e & 1);
                    if (key > pos[mt][e >> 1]) s[mt][n][e] = -INFINITY;
                }
    }
    // Row maxima by a tree (three dependent steps instead of eight), then across a row's
    // four lanes. A row whose keys in this tile all lie past it keeps its maximum; every
    // row has seen key 0 by then, so the maxima are finite.
    float mx[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float r0[KEY_TILES / 2], r1[KEY_TILES / 2];
#pragma unroll
        for (int n = 0; n < KEY_TILES / 2; ++n) {
            r0[n] = fmaxf(fmaxf(s[mt][2 * n][0], s[mt][2 * n][1]), fmaxf(s[mt][2 * n + 1][0], s[mt][2 * n + 1][1]));
            r1[n] = fmaxf(fmaxf(s[mt][2 * n][2], s[mt][2 * n][3]), fmaxf(s[mt][2 * n + 1][2], s[mt][2 * n + 1][3]));
        }
#pragma unroll
        for (int w = KEY_TILES / 4; w > 0; w /= 2) {
#pragma unroll
            for (int n = 0; n < w; ++n) {
                r0[n] = fmaxf(r0[n], r0[n + w]);
                r1[n] = fmaxf(r1[n], r1[n + w]);
            }
        }
        mx[mt][0] = fmaxf(m[mt][0], r0[0]);
        mx[mt][1] = fmaxf(m[mt][1], r1[0]);
    }
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[mt][r] = fmaxf(mx[mt][r], __shfl_xor_sync(FULL_MASK, mx[mt][r], 1));
            mx[mt][r] = fmaxf(mx[mt][r], __shfl_xor_sync(FULL_MASK, mx[mt][r], 2));
            moved |= mx[mt][r] != m[mt][r];
        }
    // 0 on the first tile (m = -inf). Where no row of the warp has a new maximum every
    // factor is 1: the multiplications are skipped.
    if (__any_sync(FULL_MASK, moved)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float corr0 = fast_exp2((m[mt][0] - mx[mt][0]) * scale_log2);
            const float corr1 = fast_exp2((m[mt][1] - mx[mt][1]) * scale_log2);
            m[mt][0] = mx[mt][0];
            m[mt][1] = mx[mt][1];
            l[mt][0] *= corr0;
            l[mt][1] *= corr1;
#pragma unroll
            for (int n = 0; n < DIM_TILES; ++n) {
                o[mt][n][0] *= corr0;
                o[mt][n][1] *= corr0;
                o[mt][n][2] *= corr1;
                o[mt][n][3] *= corr1;
            }
        }
    }
    // A tile's p summed in two independent chains per row.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const float ms0 = m[mt][0] * scale_log2, ms1 = m[mt][1] * scale_log2;
        float t0[2] = {0.f, 0.f}, t1[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n) {
            const float p0 = fast_exp2(fmaf(s[mt][n][0], scale_log2, -ms0));
            const float p1 = fast_exp2(fmaf(s[mt][n][1], scale_log2, -ms0));
            const float p2 = fast_exp2(fmaf(s[mt][n][2], scale_log2, -ms1));
            const float p3 = fast_exp2(fmaf(s[mt][n][3], scale_log2, -ms1));
            t0[n & 1] += p0 + p1;
            t1[n & 1] += p2 + p3;
            pa[mt][n / 2][(n % 2) * 2] = pack_bf16(p0, p1);
            pa[mt][n / 2][(n % 2) * 2 + 1] = pack_bf16(p2, p3);
        }
        l[mt][0] += t0[0] + t0[1];
        l[mt][1] += t1[0] + t1[1];
    }
}

// The finished rows of a warp's MT query tiles: o / l, the sums across a row's four
// lanes, stored in bf16 for the query rows row0[mt] and row0[mt] + 8 that exist.
template <int MT, int DIM_TILES>
__device__ __forceinline__ void store_rows(__nv_bfloat16* __restrict__ out, const float (&o)[MT][DIM_TILES][4],
                                           const float (&l)[MT][2], const int (&row0)[MT], int b, int h, int heads,
                                           int t, int c) {
    constexpr int HD = DIM_TILES * 8;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float l0 = l[mt][0], l1 = l[mt][1];
        l0 += __shfl_xor_sync(FULL_MASK, l0, 1);
        l0 += __shfl_xor_sync(FULL_MASK, l0, 2);
        l1 += __shfl_xor_sync(FULL_MASK, l1, 1);
        l1 += __shfl_xor_sync(FULL_MASK, l1, 2);
        const float inv0 = 1.f / l0, inv1 = 1.f / l1;
        const int r0 = row0[mt], r1 = r0 + 8;
#pragma unroll
        for (int n = 0; n < DIM_TILES; ++n) {
            const int col = n * 8 + 2 * c;
            if (r0 < t)
                *reinterpret_cast<__nv_bfloat162*>(out + out_row(b, h, r0, heads, t, HD) + col) =
                    __floats2bfloat162_rn(o[mt][n][0] * inv0, o[mt][n][1] * inv0);
            if (r1 < t)
                *reinterpret_cast<__nv_bfloat162*>(out + out_row(b, h, r1, heads, t, HD) + col) =
                    __floats2bfloat162_rn(o[mt][n][2] * inv1, o[mt][n][3] * inv1);
        }
    }
}

template <int HD>
__device__ void attend(const __nv_bfloat16* __restrict__ q,  // [b, heads, t, HD], strided
                       const __nv_bfloat16* __restrict__ k,  // [b, kv_heads, T, HD], strided
                       const __nv_bfloat16* __restrict__ v,  // [b, kv_heads, T, HD], strided
                       __nv_bfloat16* __restrict__ out,      // [b, t, heads, HD]
                       int heads, int kv_heads, int t, int T, float scale, Strides qs, Strides kst,
                       Strides vst,
                       const __nv_bfloat16* __restrict__ q_angles) {  // [t, HD] cos | sin, or null
    // Rows padded by 16 bytes: the 8 rows one ldmatrix phase reads fall in distinct banks.
    constexpr int STRIDE = HD + 8;
    constexpr int KSTEPS = HD / 16;      // mma k-steps over the head dims (S = Q Kᵀ)
    constexpr int DIM_TILES = HD / 8;    // mma n-tiles over the head dims (O = P V)
    constexpr int KEY_TILES = ATT_KEYS / 8;
    constexpr int CHUNKS = ATT_KEYS * HD / VEC;  // 16-byte pieces of one K (or V) tile
    constexpr int MT = ATT_MTILES;
    // Two stages: the next tile's copies fly while this one is computed.
    __shared__ __align__(16) __nv_bfloat16 ks[2][ATT_KEYS][STRIDE];
    __shared__ __align__(16) __nv_bfloat16 vs[2][ATT_KEYS][STRIDE];
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (heads / kv_heads);
    const int past = T - t;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;  // the fragment row and column pair of this lane
    // The last query blocks see the most keys: start them first.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * ATT_QUERIES;
    const int wq0 = q0 + warp * 16 * MT;
    // Query rows of this lane: g and g + 8 of each of the warp's MT tiles of 16.
    int row0[MT], pos[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        row0[mt] = wq0 + mt * 16 + g;
        pos[mt][0] = past + row0[mt];
        pos[mt][1] = pos[mt][0] + 8;
    }

    // Keys past T are zeros: their scores are masked, and a zero V keeps 0 · V finite.
    // Each thread copies PIECES 16-byte pieces of every K and V tile, PIECE_ROWS rows
    // apart; their source rows are kept as pointers, advanced by a tile a step, instead of
    // indexing (batch, head, key) with 64-bit products for every piece.
    constexpr int PIECES = CHUNKS / (ATT_WARPS * 32);
    static_assert(CHUNKS % (ATT_WARPS * 32) == 0, "a K tile splits evenly over the threads");
    constexpr int PIECE_ROWS = ATT_WARPS * 32 / (HD / VEC);
    const int piece_row = threadIdx.x / (HD / VEC), piece_col = (threadIdx.x % (HD / VEC)) * VEC;
    // This thread's first piece of the next tile to stage (stage() is called for k0 = 0,
    // ATT_KEYS, 2 ATT_KEYS, ... in turn).
    const __nv_bfloat16* k_next = k + kst.row(b, kvh, piece_row) + piece_col;
    const __nv_bfloat16* v_next = v + vst.row(b, kvh, piece_row) + piece_col;
    auto stage = [&](int buf, int k0) {
#pragma unroll
        for (int i = 0; i < PIECES; ++i) {
            const int r = piece_row + i * PIECE_ROWS;
            const bool valid = k0 + r < T;
            const long long rows = static_cast<long long>(i) * PIECE_ROWS;
            copy16_async(&ks[buf][r][piece_col], valid ? k_next + rows * kst.t : k, valid);
            copy16_async(&vs[buf][r][piece_col], valid ? v_next + rows * vst.t : v, valid);
        }
        k_next += static_cast<long long>(ATT_KEYS) * kst.t;
        v_next += static_cast<long long>(ATT_KEYS) * vst.t;
        async_commit();
    };
    const int block_last = past + min(q0 + ATT_QUERIES, t) - 1;  // the furthest key of the block
    const int warp_last = past + min(wq0 + 16 * MT - 1, t - 1);   // ... and of this warp
    stage(0, 0);

    uint32_t qa[MT][KSTEPS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int r0 = row0[mt], r1 = r0 + 8;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const int col = kk * 16 + 2 * c;
            const __nv_bfloat16* q0r = q + qs.row(b, h, r0) + col;
            const __nv_bfloat16* q1r = q + qs.row(b, h, r1) + col;
            qa[mt][kk][0] = r0 < t ? load_pair(q0r) : 0u;
            qa[mt][kk][1] = r1 < t ? load_pair(q1r) : 0u;
            qa[mt][kk][2] = r0 < t ? load_pair(q0r + 8) : 0u;
            qa[mt][kk][3] = r1 < t ? load_pair(q1r + 8) : 0u;
        }
    }
    // q as the projection gave it (`q_angles` set): turned here (RoPE), where rope.cu
    // would have read and written all of it once more. A lane's fragment of dims
    // kk·16 + … and its partner hd/2 further (k-step kk + KSTEPS/2) are the pairs RoPE
    // mixes; element e is row r0 or r1 (e & 1) and columns + 0 or + 8 (e >> 1).
    if (q_angles != nullptr) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < KSTEPS / 2; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = row0[mt] + (e & 1) * 8;
                    const int col = kk * 16 + 2 * c + (e >> 1) * 8;
                    if (r < t)
                        turn_pair(qa[mt][kk][e], qa[mt][kk + KSTEPS / 2][e],
                                  q_angles + static_cast<long long>(r) * HD + col, HD / 2);
                }
    }
    float o[MT][DIM_TILES][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < DIM_TILES; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }
    const float scale_log2 = scale * LOG2_E;

    for (int k0 = 0, buf = 0; k0 <= block_last; k0 += ATT_KEYS, buf ^= 1) {
        // The other stage was read in the previous step, finished before its closing sync.
        if (k0 + ATT_KEYS <= block_last) {
            stage(buf ^ 1, k0 + ATT_KEYS);
            async_wait<1>();  // this stage's copies have landed, the next may fly
        } else {
            async_wait<0>();
        }
        __syncthreads();  // ... everyone's
        if (wq0 < t && k0 <= warp_last) {  // the same in every lane of the warp
            // S = Q Kᵀ: each K fragment feeds the MT query tiles.
            float s[MT][KEY_TILES][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < KEY_TILES; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
                for (int np = 0; np < KEY_TILES / 2; ++np) {
                    // Matrices: keys of tiles 2np and 2np + 1, dims kk·16 and kk·16 + 8.
                    uint32_t kb[4];
                    ldmatrix_x4(kb, &ks[buf][(2 * np + (lane >> 4)) * 8 + (lane & 7)][kk * 16 + ((lane >> 3) & 1) * 8]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816(s[mt][2 * np], qa[mt][kk], kb[0], kb[1]);
                        mma_16816(s[mt][2 * np + 1], qa[mt][kk], kb[2], kb[3]);
                    }
                }
            }
            uint32_t pa[MT][ATT_KEYS / 16][4];
            softmax_tile(s, m, l, o, pa, pos, k0, c, scale_log2);
            // O += P V: each V fragment feeds the MT query tiles.
#pragma unroll
            for (int kk = 0; kk < ATT_KEYS / 16; ++kk) {
#pragma unroll
                for (int np = 0; np < HD / 16; ++np) {
                    // Matrices: keys 0-7 and 8-15 of the k-step, at dims np·16 and np·16 + 8.
                    uint32_t bv[4];
                    ldmatrix_x4_trans(bv, &vs[buf][kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][np * 16 + (lane >> 4) * 8]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816(o[mt][2 * np], pa[mt][kk], bv[0], bv[1]);
                        mma_16816(o[mt][2 * np + 1], pa[mt][kk], bv[2], bv[3]);
                    }
                }
            }
        }
        __syncthreads();  // this stage is read; the next step may refill it
    }
    store_rows(out, o, l, row0, b, h, heads, t, c);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Hopper (sm_90a): both products by wgmma, issued by a warpgroup (4 warps) for 64 queries.
// Q, K and V sit in shared memory in the layout wgmma reads through a descriptor: rows of
// 64 bf16 (128 bytes), the 16-byte pieces of row r stored at piece ^ (r % 8) (the 128-byte
// swizzle), 8-row groups 1024 bytes apart. S = Q Kᵀ reads Q and K from there (both
// K-major); O += P V takes P from registers, in the accumulator layout S came out in, and
// V from there (N-major, transposed by the instruction). No ldmatrix, and per 64-key tile
// a warpgroup issues 8 wgmma where each of its warps issued 64 mma.sync.

// Descriptor of a 128-byte-swizzled tile at `p` (1024-byte aligned for the first k-step;
// a k-step inside the row adds its byte offset to the address): start address >> 4,
// leading offset 1 (unused with this swizzle), stride 1024 bytes between 8-row groups,
// swizzle mode 1 (128 bytes).
__device__ __forceinline__ uint64_t swizzled_desc(const void* p) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
           (1ull << 62);
}

// Element offset of (row, 16-byte piece) in a 128-byte-swizzled tile of 64-wide rows.
__device__ __forceinline__ int swizzled(int row, int piece) { return row * 64 + ((piece ^ (row & 7)) * VEC); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of this thread's committed wgmma groups are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of an accumulator across the
// asynchronous products (it does not know the registers change under it).
__device__ __forceinline__ void hold(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void hold(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
template <typename T, int N, int E>
__device__ __forceinline__ void hold(T (&x)[N][E]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < E; ++e) hold(x[n][e]);
}
template <int N, int E>
__device__ __forceinline__ void zero(uint32_t (&x)[N][E]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < E; ++e) x[n][e] = 0u;
}
// Shared memory written through the generic proxy (cp.async), read next by wgmma.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define WGMMA_D32(d, C)                                                                                        \
    C(d[0][0]), C(d[0][1]), C(d[0][2]), C(d[0][3]), C(d[1][0]), C(d[1][1]), C(d[1][2]), C(d[1][3]), C(d[2][0]), \
        C(d[2][1]), C(d[2][2]), C(d[2][3]), C(d[3][0]), C(d[3][1]), C(d[3][2]), C(d[3][3]), C(d[4][0]),         \
        C(d[4][1]), C(d[4][2]), C(d[4][3]), C(d[5][0]), C(d[5][1]), C(d[5][2]), C(d[5][3]), C(d[6][0]),         \
        C(d[6][1]), C(d[6][2]), C(d[6][3]), C(d[7][0]), C(d[7][1]), C(d[7][2]), C(d[7][3])
#define WGMMA_REGS32                                                                                       \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64 f32, this thread's 32) = a · bᵀ (+ d when ACCUMULATE), a and b K-major
// tiles in shared memory (16 of the K dims each). Without ACCUMULATE d is only written,
// so nothing has to set it first.
template <bool ACCUMULATE>
__device__ __forceinline__ void wgmma_ss(float (&d)[8][4], uint64_t a, uint64_t b) {
    if (ACCUMULATE) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_REGS32 ", %32, %33, 1, 1, 1, 0, 0;\n"
                     : WGMMA_D32(d, "+f")
                     : "l"(a), "l"(b));
    } else {
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_REGS32 ", %32, %33, 0, 1, 1, 0, 0;\n"
                     : WGMMA_D32(d, "=f")
                     : "l"(a), "l"(b));
    }
}

// d (64 x 64 f32) += a · b, a this thread's A fragment (64 x 16 bf16, rows as mma.sync's
// m16 tiles, one per warp), b N-major in shared memory (16 rows of K).
__device__ __forceinline__ void wgmma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_REGS32 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
        : WGMMA_D32(d, "+f")
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// The kernel above on wgmma: 128 queries a block, two warpgroups of 64, a warp's 16 rows
// as one m16 tile (rows wq0 + g and + 8), the same softmax. Sixteen warps an SM at 111
// registers, against eight for the mma.sync kernel's two tiles a warp: measured on the
// H200 at 4 x 2048 x 32 heads, 229 µs against 246 for one warpgroup of two tiles a warp
// and 280 for mma.sync (H200).
__device__ void attend_wgmma(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                             const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, int heads,
                             int kv_heads, int t, int T, float scale, Strides qs, Strides kst, Strides vst,
                             const __nv_bfloat16* __restrict__ q_angles) {  // [t, HD] cos | sin, or null
    constexpr int HD = 64;  // one 128-byte swizzled row
    constexpr int DIM_TILES = HD / 8;
    constexpr int PIECES_ROW = HD / VEC;  // 16-byte pieces of a row
    constexpr int THREADS = ATT_WGMMA_WARPS * 32;
    constexpr int MT = 1;
    static_assert(ATT_WGMMA_WARPS * 16 == ATT_QUERIES && ATT_KEYS == 64, "a warp's 16 queries, 64-key tiles");
    // 16 + 2 x 8 + 2 x 8 KB: the 48 KB of static shared memory. Query q0 + r is Q's row r:
    // warpgroup wg's wgmma reads rows 64·wg .. 64·wg + 63, 16 of each of its warps.
    __shared__ __align__(1024) __nv_bfloat16 qsm[ATT_QUERIES * HD];
    __shared__ __align__(1024) __nv_bfloat16 ksm[2][ATT_KEYS * HD];
    __shared__ __align__(1024) __nv_bfloat16 vsm[2][ATT_KEYS * HD];
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (heads / kv_heads);
    const int past = T - t;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * ATT_QUERIES;
    const int wq0 = q0 + warp * 16;
    const int row0[MT] = {wq0 + g};
    const int pos[MT][2] = {{past + row0[0], past + row0[0] + 8}};

    // Each thread stages one 16-byte piece (column `piece`) of rows piece_row + i·ROWS_A_PASS.
    constexpr int ROWS_A_PASS = THREADS / PIECES_ROW;
    const int piece_row = threadIdx.x / PIECES_ROW, piece = threadIdx.x % PIECES_ROW;
    if (q_angles == nullptr) {
#pragma unroll
        for (int i = 0; i < ATT_QUERIES / ROWS_A_PASS; ++i) {
            const int r = piece_row + i * ROWS_A_PASS;
            const bool valid = q0 + r < t;
            copy16_async(&qsm[swizzled(r, piece)], valid ? q + qs.row(b, h, q0 + r) + piece * VEC : q, valid);
        }
    } else {
        // q as the projection gave it: a thread turns (RoPE) a piece of the first half of
        // a row with its partner hd/2 further and stores both, where rope.cu would have
        // read and written all of q once more. The fence before the first product orders
        // these stores before wgmma reads them, as it does the copies.
        constexpr int HALF_PIECES = PIECES_ROW / 2;
        constexpr int ROWS_TURNED = THREADS / HALF_PIECES;
        const int turn_row = threadIdx.x / HALF_PIECES, turn_piece = threadIdx.x % HALF_PIECES;
#pragma unroll
        for (int i = 0; i < ATT_QUERIES / ROWS_TURNED; ++i) {
            const int r = turn_row + i * ROWS_TURNED;
            float o1[VEC] = {}, o2[VEC] = {};  // rows past t stay zeros
            if (q0 + r < t) {
                const __nv_bfloat16* src = q + qs.row(b, h, q0 + r) + turn_piece * VEC;
                const __nv_bfloat16* cs = q_angles + static_cast<long long>(q0 + r) * HD + turn_piece * VEC;
                float x1[VEC], x2[VEC], co[VEC], sn[VEC];
                load8(src, x1);
                load8(src + HD / 2, x2);
                load8(cs, co);
                load8(cs + HD / 2, sn);
#pragma unroll
                for (int e = 0; e < VEC; ++e) rope_turn(x1[e], x2[e], co[e], sn[e], o1[e], o2[e]);
            }
            store8(&qsm[swizzled(r, turn_piece)], o1);
            store8(&qsm[swizzled(r, turn_piece + HALF_PIECES)], o2);
        }
    }
    const __nv_bfloat16* k_next = k + kst.row(b, kvh, piece_row) + piece * VEC;
    const __nv_bfloat16* v_next = v + vst.row(b, kvh, piece_row) + piece * VEC;
    auto stage = [&](int buf, int k0) {
#pragma unroll
        for (int i = 0; i < ATT_KEYS / ROWS_A_PASS; ++i) {
            const int r = piece_row + i * ROWS_A_PASS;
            const bool valid = k0 + r < T;
            const long long rows = static_cast<long long>(i) * ROWS_A_PASS;
            copy16_async(&ksm[buf][swizzled(r, piece)], valid ? k_next + rows * kst.t : k, valid);
            copy16_async(&vsm[buf][swizzled(r, piece)], valid ? v_next + rows * vst.t : v, valid);
        }
        k_next += static_cast<long long>(ATT_KEYS) * kst.t;
        v_next += static_cast<long long>(ATT_KEYS) * vst.t;
        async_commit();
    };
    const int block_last = past + min(q0 + ATT_QUERIES, t) - 1;
    const int warp_last = past + min(wq0 + 15, t - 1);
    stage(0, 0);  // with Q's pieces in its group

    // This warpgroup's 64 rows of Q start (warp / 4) · 8 KB in; stage buf's K and V buf · 8 KB in.
    const uint64_t q_desc = swizzled_desc(qsm) + (((warp >> 2) * 64 * HD * 2) >> 4);
    const uint64_t k_desc0 = swizzled_desc(ksm[0]), v_desc0 = swizzled_desc(vsm[0]);
    constexpr int STAGE_STEP = ATT_KEYS * HD * 2 >> 4;
    float o[MT][DIM_TILES][4];
    float m[MT][2] = {{-INFINITY, -INFINITY}}, l[MT][2] = {{0.f, 0.f}};
#pragma unroll
    for (int n = 0; n < DIM_TILES; ++n) o[0][n][0] = o[0][n][1] = o[0][n][2] = o[0][n][3] = 0.f;
    const float scale_log2 = scale * LOG2_E;

    for (int k0 = 0, buf = 0; k0 <= block_last; k0 += ATT_KEYS, buf ^= 1) {
        if (k0 + ATT_KEYS <= block_last) {
            stage(buf ^ 1, k0 + ATT_KEYS);
            async_wait<1>();
        } else {
            async_wait<0>();
        }
        fence_async_shared();  // this thread's copies, before wgmma reads them
        __syncthreads();
        // S = Q Kᵀ: four k-steps of 16 dims, 32 bytes further along the swizzled rows each.
        float s[MT][ATT_KEYS / 8][4];
        wgmma_fence();
        wgmma_ss<false>(s[0], q_desc, k_desc0 + buf * STAGE_STEP);
#pragma unroll
        for (int kk = 1; kk < HD / 16; ++kk)
            wgmma_ss<true>(s[0], q_desc + ((kk * 32) >> 4), k_desc0 + buf * STAGE_STEP + ((kk * 32) >> 4));
        wgmma_commit();
        wgmma_wait<0>();
        hold(s[0]);
        // A warp whose rows all lie before this tile's keys (or past t) still joins its
        // warpgroup's P V, with P = 0.
        uint32_t pa[MT][ATT_KEYS / 16][4];
        if (wq0 < t && k0 <= warp_last) {
            softmax_tile(s, m, l, o, pa, pos, k0, c, scale_log2);
        } else {
            zero(pa[0]);
        }
        hold(o[0]);
        hold(pa[0]);
        // O += P V: four k-steps of 16 keys, 2048 bytes of V each.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < ATT_KEYS / 16; ++kk)
            wgmma_rs(o[0], pa[0][kk], v_desc0 + buf * STAGE_STEP + ((kk * 16 * HD * 2) >> 4));
        wgmma_commit();
        wgmma_wait<0>();
        hold(o[0]);
        __syncthreads();  // this stage is read; the next step may refill it
    }
    store_rows(out, o, l, row0, b, h, heads, t, c);
}

extern "C" __global__ void __launch_bounds__(ATT_WGMMA_WARPS * 32, 2)
    causal_attention_wgmma_bf16_hd64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                                     const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, int heads,
                                     int kv_heads, int t, int T, float scale, Strides qs, Strides ks, Strides vs,
                                     const __nv_bfloat16* __restrict__ q_angles) {
    attend_wgmma(q, k, v, out, heads, kv_heads, t, T, scale, qs, ks, vs, q_angles);
}
#endif

#define ATTEND_KERNEL(HD)                                                                         \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32, 2) causal_attention_bf16_hd##HD( \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                 \
        const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, int heads,          \
        int kv_heads, int t, int T, float scale, Strides qs, Strides ks, Strides vs,              \
        const __nv_bfloat16* __restrict__ q_angles) {                                             \
        attend<HD>(q, k, v, out, heads, kv_heads, t, T, scale, qs, ks, vs, q_angles);             \
    }
ATTEND_KERNEL(64)

// Decode: one query row per (batch, head), attending all T keys. A block of
// DECODE_THREADS per (batch, head): eight lanes a key score into shared memory, the block
// reduces the maximum and the sum, then each thread sums p · v for a pair of dims over
// its share of the keys, and the shares meet in shared memory.
#define DECODE_THREADS 256

// The decode attention of block (head, batch) once its query sits scaled in `qs`, over
// the T keys j0 .. j0 + T - 1 of KV head `kvh` (scores in `scores`) and, with `xk, xv`
// (shared memory, or null), one more key and value after them. Leaves the block's running
// maximum m and sum l of exp(s - m) in every thread, and in threads tid < HD / 2 the
// unnormalised sums Σ p · v of their pair of dims.
template <int HD>
__device__ __forceinline__ void attend_range(const float* qs, const __nv_bfloat16* __restrict__ k,
                                             const __nv_bfloat16* __restrict__ v, int kvh, int j0, int T,
                                             Strides kst, Strides vst, float* scores, const float* xk,
                                             const float* xv, float& m_out, float& l_out, float2& o_out) {
    __shared__ float reduce[DECODE_THREADS / 32];
    constexpr int PAIRS = HD / 2;
    constexpr int OCTS = HD / VEC;                // 16-byte pieces of a row
    constexpr int ROWS = DECODE_THREADS / OCTS;   // value rows one pass of the block reads
    static_assert(32 % OCTS == 0, "a warp holds whole rows");
    __shared__ float part[DECODE_THREADS / 32][HD];
    const int b = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // Scores: OCTS lanes a key, each dotting one 16-byte piece of it, so that a warp's
    // load covers whole rows (4 keys of 128 bytes at HD 64): with a thread a key, each
    // load took half of 32 sectors and the next load the other halves, and at 64
    // sequences the keys were read from memory about twice. KEYS_IN_FLIGHT keys a lane.
    constexpr int KEYS_IN_FLIGHT = 8;
    const int oct = tid % OCTS, group = tid / OCTS;
    float qv[VEC];
#pragma unroll
    for (int c = 0; c < VEC; ++c) qv[c] = qs[VEC * oct + c];
    float m = -INFINITY;
    for (int base = 0; base < T; base += ROWS * KEYS_IN_FLIGHT) {
        uint4 kp[KEYS_IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < KEYS_IN_FLIGHT; ++u) {
            const int j = base + group + ROWS * u;
            kp[u] = j < T ? *reinterpret_cast<const uint4*>(k + kst.row(b, kvh, j0 + j) + VEC * oct)
                          : make_uint4(0u, 0u, 0u, 0u);
            // The value row is read after the softmax's reductions: on its way to L2 meanwhile.
            if (j < T && oct == 0) prefetch_l2(v + vst.row(b, kvh, j0 + j));
        }
#pragma unroll
        for (int u = 0; u < KEYS_IN_FLIGHT; ++u) {
            const int j = base + group + ROWS * u;
            const __nv_bfloat162* kh = reinterpret_cast<const __nv_bfloat162*>(&kp[u]);
            float s = 0.f;
#pragma unroll
            for (int q = 0; q < VEC / 2; ++q) {
                const float2 kf = __bfloat1622float2(kh[q]);
                s = fmaf(qv[2 * q], kf.x, s);
                s = fmaf(qv[2 * q + 1], kf.y, s);
            }
#pragma unroll
            for (int o = 1; o < OCTS; o <<= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
            if (j < T && oct == 0) {
                scores[j] = s;
                m = fmaxf(m, s);
            }
        }
    }
    const int n = xk != nullptr ? T + 1 : T;
    if (xk != nullptr && tid == 0) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < HD; ++e) s = fmaf(qs[e], xk[e], s);
        scores[T] = s;
        m = fmaxf(m, s);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
    if (lane == 0) reduce[warp] = m;
    __syncthreads();
    m = reduce[0];
#pragma unroll
    for (int w = 1; w < DECODE_THREADS / 32; ++w) m = fmaxf(m, reduce[w]);
    __syncthreads();  // every thread has read `reduce` before it is reused

    float l = 0.f;
    for (int j = tid; j < n; j += DECODE_THREADS) {
        const float p = __expf(scores[j] - m);
        scores[j] = p;
        l += p;
    }
    l = warp_sum(l);
    if (lane == 0) reduce[warp] = l;
    __syncthreads();  // also publishes every p in `scores`
    l = 0.f;
#pragma unroll
    for (int w = 0; w < DECODE_THREADS / 32; ++w) l += reduce[w];

    // p · v: a thread takes 8 dims of a row (one 16-byte load), so a pass of the block
    // covers ROWS rows and the unrolled loop keeps 8 loads in flight per thread: the
    // value rows arrive in one or two memory round trips instead of one per 4 bytes.
    const __nv_bfloat16* vp = v + vst.row(b, kvh, j0) + VEC * oct;
    float acc[VEC] = {};
#pragma unroll 8
    for (int j = group; j < T; j += ROWS) {
        float vf[VEC];
        load8(vp + static_cast<long long>(j) * vst.t, vf);
        const float p = scores[j];
#pragma unroll
        for (int c = 0; c < VEC; ++c) acc[c] = fmaf(p, vf[c], acc[c]);
    }
    if (xv != nullptr && group == 0) {
        const float p = scores[T];
#pragma unroll
        for (int c = 0; c < VEC; ++c) acc[c] = fmaf(p, xv[VEC * oct + c], acc[c]);
    }
    // The lanes of a warp holding the same dims meet by shuffles, the warps in shared memory.
#pragma unroll
    for (int c = 0; c < VEC; ++c) {
#pragma unroll
        for (int o = OCTS; o < 32; o <<= 1) acc[c] += __shfl_xor_sync(FULL_MASK, acc[c], o);
    }
    if (lane < OCTS) {
#pragma unroll
        for (int c = 0; c < VEC; ++c) part[warp][VEC * lane + c] = acc[c];
    }
    __syncthreads();
    float2 o = make_float2(0.f, 0.f);
    if (tid < PAIRS) {
#pragma unroll
        for (int w = 0; w < DECODE_THREADS / 32; ++w) {
            o.x += part[w][2 * tid];
            o.y += part[w][2 * tid + 1];
        }
    }
    m_out = m;
    l_out = l;
    o_out = o;
}

// The decode attention of block (head, batch) over all T keys (and the extra one), into
// its output row.
template <int HD>
__device__ __forceinline__ void attend_one_from(const float* qs, const __nv_bfloat16* __restrict__ k,
                                                const __nv_bfloat16* __restrict__ v,
                                                __nv_bfloat16* __restrict__ out, int heads, int kvh,
                                                int T, Strides kst, Strides vst, float* scores,
                                                const float* xk, const float* xv) {
    float m, l;
    float2 o;
    attend_range<HD>(qs, k, v, kvh, 0, T, kst, vst, scores, xk, xv, m, l, o);
    if (threadIdx.x < HD / 2) {
        const float inv = 1.f / l;
        *reinterpret_cast<__nv_bfloat162*>(out + out_row(blockIdx.y, blockIdx.x, 0, heads, 1, HD) +
                                           2 * threadIdx.x) = __floats2bfloat162_rn(o.x * inv, o.y * inv);
    }
}

template <int HD>
__device__ void attend_one(const __nv_bfloat16* __restrict__ q,  // [b, heads, 1, HD], strided
                           const __nv_bfloat16* __restrict__ k,  // [b, kv_heads, T, HD], strided
                           const __nv_bfloat16* __restrict__ v,  // [b, kv_heads, T, HD], strided
                           __nv_bfloat16* __restrict__ out,      // [b, 1, heads, HD]
                           int heads, int kv_heads, int T, float scale, Strides qst, Strides kst,
                           Strides vst) {
    extern __shared__ float scores[];  // [T]
    __shared__ float qs[HD];
    const int h = blockIdx.x, b = blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int tid = threadIdx.x;
    const long long q_row = qst.row(b, h, 0);
    for (int e = tid; e < HD; e += DECODE_THREADS) qs[e] = __bfloat162float(q[q_row + e]) * scale;
    __syncthreads();
    attend_one_from<HD>(qs, k, v, out, heads, kvh, T, kst, vst, scores, nullptr, nullptr);
}

#define ATTEND_ONE_KERNEL(HD)                                                                     \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) causal_attention_decode_bf16_hd##HD( \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                 \
        const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, int heads,          \
        int kv_heads, int T, float scale, Strides qs, Strides ks, Strides vs) {                   \
        attend_one<HD>(q, k, v, out, heads, kv_heads, T, scale, qs, ks, vs);                      \
    }
ATTEND_ONE_KERNEL(64)

// One decode step with its own projections: block (head, batch) turns its query head
// (RoPE at the step's position, rounded to bf16 as the RoPE kernel writes it), turns its
// KV head's key and copies its value into the cache's next position, then attends over
// the cache. The new key and value also stay in shared memory, where the attention reads
// them: the blocks of the heads sharing a KV head write the same bytes to the same place,
// and no block reads what another writes, so the cached positions before the step are
// read-only for the kernel (the non-coherent load path, as in the decode kernel). One
// launch where RoPE, the cache append and the attention took three.
//
// With few sequences, (head, batch) blocks alone would leave most of the card idle while
// each reads its whole share of the cache, so the cached positions are split over
// `splits` blocks (blockIdx.z, `chunk` positions each; the last also takes the new key).
// Each leaves its maximum, sum and unnormalised p · v in `part` ([b, heads, splits] of
// (m, l, HD sums)); the last block of a (head, batch) to finish (a ticket counter after a
// fence, as in the one-token MLP) merges them into the output row and zeroes its ticket.
template <int HD>
__device__ void attend_step(const __nv_bfloat16* __restrict__ qkv,       // [b, (heads + 2 kv_heads) HD]
                            const __nv_bfloat16* __restrict__ cs,        // [HD]: cos, then sin
                            const __nv_bfloat16* __restrict__ cache_in,  // [b, cap, 2 kv_heads HD]
                            __nv_bfloat16* cache_out,                    // the same buffer
                            __nv_bfloat16* __restrict__ out,             // [b, heads HD]
                            int heads, int kv_heads, int len, long long cache_b, float scale,
                            int chunk,        // cached positions per split (len with one split)
                            float* part,      // [b, heads, splits, 2 + HD], with splits > 1
                            uint32_t* tickets,  // [b, heads], zero, with splits > 1
                            const uint32_t* __restrict__ positions,  // [b] or null: len per row
                            const uint32_t* __restrict__ slots) {    // [b] or null: cache row
    extern __shared__ float scores[];  // [chunk + 1]
    __shared__ float qs[HD], ks[HD], vs[HD];
    const int h = blockIdx.x, b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int kvh = h / (heads / kv_heads);
    const int tid = threadIdx.x;
    constexpr int HALF = HD / 2;
    const long long w = static_cast<long long>(kv_heads) * HD;
    // With `positions`, each row has its own length and its angles are row `len` of the
    // whole table; with `slots`, its cache is row `slots[b]` of the buffer. The cache
    // pointers are moved to that row, so the reads below address it as batch 0.
    if (positions != nullptr) {
        len = static_cast<int>(positions[b]);
        cs += static_cast<long long>(len) * HD;
    }
    const long long cache_row = slots != nullptr ? static_cast<long long>(slots[b]) : b;
    cache_in += cache_row * cache_b;
    cache_out += cache_row * cache_b;
    const __nv_bfloat16* row = qkv + static_cast<long long>(b) * (heads * HD + 2 * w);
    __nv_bfloat16* slot = cache_out + static_cast<long long>(len) * 2 * w;
    // The split whose positions the new key follows: the last one when the splits were
    // planned for this length, the one holding `len` when they cover a fixed capacity.
    const bool last_split = split == min(len / max(chunk, 1), splits - 1);
    if (tid < HALF) {
        const float co = __bfloat162float(cs[tid]), sn = __bfloat162float(cs[HALF + tid]);
        const __nv_bfloat16* qr = row + h * HD;
        const float q1 = __bfloat162float(qr[tid]), q2 = __bfloat162float(qr[HALF + tid]);
        float t1, t2;
        rope_turn(q1, q2, co, sn, t1, t2);
        qs[tid] = round_bf16(t1) * scale;
        qs[HALF + tid] = round_bf16(t2) * scale;
        if (last_split) {
            const __nv_bfloat16* kr = row + heads * HD + kvh * HD;
            const float k1 = __bfloat162float(kr[tid]), k2 = __bfloat162float(kr[HALF + tid]);
            rope_turn(k1, k2, co, sn, t1, t2);
            const __nv_bfloat16 o1 = __float2bfloat16(t1);
            const __nv_bfloat16 o2 = __float2bfloat16(t2);
            slot[kvh * HD + tid] = o1;
            slot[kvh * HD + HALF + tid] = o2;
            ks[tid] = __bfloat162float(o1);
            ks[HALF + tid] = __bfloat162float(o2);
        }
    } else if (tid < HALF + HD && last_split) {
        const int e = tid - HALF;
        const __nv_bfloat16 x = row[heads * HD + w + kvh * HD + e];
        slot[w + kvh * HD + e] = x;
        vs[e] = __bfloat162float(x);
    }
    __syncthreads();
    const Strides kst{0, HD, 2 * w};
    if (splits == 1) {
        attend_one_from<HD>(qs, cache_in, cache_in + w, out, heads, kvh, len, kst, kst, scores, ks, vs);
        return;
    }
    const int j0 = split * chunk;
    const int n = max(0, min(chunk, len - j0));
    float m, l;
    float2 o;
    attend_range<HD>(qs, cache_in, cache_in + w, kvh, j0, n, kst, kst, scores, last_split ? ks : nullptr,
                     last_split ? vs : nullptr, m, l, o);
    const long long pair_of = static_cast<long long>(b) * heads + h;
    float* mine = part + (pair_of * splits + split) * (2 + HD);
    if (tid == 0) {
        mine[0] = m;
        mine[1] = l;
    }
    if (tid < HALF) {
        mine[2 + 2 * tid] = o.x;
        mine[3 + 2 * tid] = o.y;
    }
    __shared__ bool merges;
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        merges = atomicAdd(tickets + pair_of, 1u) == static_cast<uint32_t>(splits - 1);
    }
    __syncthreads();
    if (!merges) return;
    __threadfence();
    if (tid < HALF) {
        const float* first = part + pair_of * splits * (2 + HD);
        float top = -INFINITY;
        for (int s = 0; s < splits; ++s) top = fmaxf(top, __ldcg(first + s * (2 + HD)));
        float sum = 0.f;
        float2 acc = make_float2(0.f, 0.f);
        for (int s = 0; s < splits; ++s) {
            const float* p = first + s * (2 + HD);
            const float f = __expf(__ldcg(p) - top);
            sum = fmaf(f, __ldcg(p + 1), sum);
            acc.x = fmaf(f, __ldcg(p + 2 + 2 * tid), acc.x);
            acc.y = fmaf(f, __ldcg(p + 3 + 2 * tid), acc.y);
        }
        const float inv = 1.f / sum;
        *reinterpret_cast<__nv_bfloat162*>(out + out_row(b, h, 0, heads, 1, HD) + 2 * tid) =
            __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    }
    if (tid == 0) tickets[pair_of] = 0u;
}

#define ATTEND_STEP_KERNEL(HD)                                                                    \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) causal_attention_step_bf16_hd##HD( \
        const __nv_bfloat16* __restrict__ qkv, const __nv_bfloat16* __restrict__ cs,              \
        const __nv_bfloat16* __restrict__ cache_in, __nv_bfloat16* cache_out,                     \
        __nv_bfloat16* __restrict__ out, int heads, int kv_heads, int len, long long cache_b,     \
        float scale, int chunk, float* part, uint32_t* tickets) {                                 \
        attend_step<HD>(qkv, cs, cache_in, cache_out, out, heads, kv_heads, len, cache_b, scale,  \
                        chunk, part, tickets, nullptr, nullptr);                                  \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) causal_attention_slots_bf16_hd##HD( \
        const __nv_bfloat16* __restrict__ qkv, const __nv_bfloat16* __restrict__ cs,              \
        const __nv_bfloat16* __restrict__ cache_in, __nv_bfloat16* cache_out,                     \
        __nv_bfloat16* __restrict__ out, int heads, int kv_heads, long long cache_b, float scale, \
        int chunk, float* part, uint32_t* tickets, const uint32_t* __restrict__ positions,        \
        const uint32_t* __restrict__ slots) {                                                     \
        attend_step<HD>(qkv, cs, cache_in, cache_out, out, heads, kv_heads, 0, cache_b, scale,    \
                        chunk, part, tickets, positions, slots);                                  \
    }
ATTEND_STEP_KERNEL(64)

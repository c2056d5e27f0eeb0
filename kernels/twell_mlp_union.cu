// twell_mlp_union: the prefill MLP's up and down projections on tensor cores, over the
// union of the neurons a tile of tokens has active.
//
// The row kernels (gated_t2d.cu) read a weight row from L2 for every active (token,
// neuron) pair, so their cost is set by the pairs' 8 KB each. Here UNION_TOKENS tokens
// share each weight row they need: at uniform density p a tile of T tokens needs a
// fraction 1 - (1 - p)^T of the neurons (27% at 0.5% and T = 64, 47% at 1%), whose rows
// are read once for the tile and multiplied on tensor cores (mma.sync m16n8k16, bf16 in,
// f32 sums), doing the tile's inactive pairs of those neurons as zeros.
//
//   bits : the gate's positive values as one bit a neuron and token tile (OR over the
//          tile's tokens), and each (token, TwELL tile)'s count of positive gates, as the
//          pack counts them (so density, L0 and overflow read as after the pack);
//   list : the token tile's union, in column order, and its length;
//   up   : h[i, k] = relu(g[i, j]) · (x_i · Wu_j) for the tile's union member k = neuron j,
//          as bf16(g · u) like the row kernels, zero where g <= 0; and each token's
//          Σ|h| over each block of the union;
//   down : out_i = Σ_k h[i, k] · Wd_j over the union, and the token's L1 term.
//
// No TwELL slots are written or read: the dense gate holds every value, so a tile past
// its capacity needs nothing of its own. Inference only (no u kept for a backward).
// Shapes: d % 32 == 0 (the k-steps of up), f % 8 == 0 (16-byte gate rows).
#include "twell_common.cuh"
#include "mma_sync.cuh"

// Tokens a tile; the blocks of up and down take one tile each.
#define UNION_TOKENS 64
// Threads of the up and down blocks: eight warps, two along the tokens and four along
// the neurons (up) or the output columns (down), 32 x 32 each.
#define UNION_THREADS 256
// Union members an up block multiplies, and output columns a down block writes, are
// the kernels' template parameter NB: 128 or 256 (`_n128`, `_n256`). Wider blocks read x
// (up) and h (down) again fewer times, at twice the registers and shared memory.
// The k-dimension a pipeline stage holds, and the stages in flight (cp.async).
#define K_STEP 32
#define STAGES 3
// Shared-memory rows are padded by 16 bytes: the eight rows one ldmatrix phase reads
// then fall in distinct banks.
#define PAD 8
// Columns a block of the bits kernel reads per token (its 32 lanes' 16-byte loads).
#define BITS_COLS 256

// One block per (token tile, 256 columns): lane q of warp s reads 16 bytes (8 neurons)
// of tokens s, s + 8, ... of the tile, so a warp's loads of one token are 512 contiguous
// bytes. Writes the tile's union as 32-bit words ([n_token_tiles, ceil(f / 32)], bit b
// of word w = neuron 32w + b) and the count of positive gates of every (token, TwELL
// tile) whose columns fall in the block's 256 (a TwELL tile, 32-256 wide, never
// straddles two blocks).
extern "C" __global__ void __launch_bounds__(256) twell_union_bits_bf16(
    const __nv_bfloat16* __restrict__ gate,  // [M, f]
    uint32_t* __restrict__ counts,           // [M, n_tiles]
    uint32_t* __restrict__ words,            // [n_token_tiles, ceil(f / 32)]
    int M, int f, int tile, int n_tiles) {
    constexpr int GROUPS = BITS_COLS / VEC;           // 32: a lane each
    constexpr int SLICES = 256 / GROUPS;              // 8 warps
    constexpr int MAX_TILES = BITS_COLS / 32;         // TwELL tiles a block may hold
    __shared__ uint32_t tile_counts[UNION_TOKENS][MAX_TILES];
    __shared__ uint32_t slice_bits[SLICES][GROUPS];
    const int tt = blockIdx.x;
    const int c0 = blockIdx.y * BITS_COLS;
    const long long r0 = static_cast<long long>(tt) * UNION_TOKENS;
    const int rows = static_cast<int>(min(static_cast<long long>(UNION_TOKENS), M - r0));
    const int q = threadIdx.x % GROUPS, s = threadIdx.x / GROUPS;  // lane, warp
    const int col = c0 + q * VEC;
    const bool col_ok = col < f;
    const int tiles_here = BITS_COLS / tile;  // tile divides 256
    const int per_tile = tile / VEC;          // lanes of one TwELL tile: 4-32
    const int t_local = q / per_tile;
    uint32_t bits = 0;
    // Token r is warp r % 8's: each (token, tile) count is one lane's sum over its
    // tile's lanes, stored once.
#pragma unroll 4
    for (int r = s; r < rows; r += SLICES) {
        uint32_t b = 0;
        if (col_ok) {
            const uint4 raw = *reinterpret_cast<const uint4*>(gate + (r0 + r) * f + col);
            const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
            for (int e = 0; e < VEC; ++e) b |= (__bfloat162float(v[e]) > 0.f ? 1u : 0u) << e;
        }
        int n = __popc(b);
        for (int o = 1; o < per_tile; o <<= 1) n += __shfl_xor_sync(FULL_MASK, n, o);
        if (q % per_tile == 0) tile_counts[r][t_local] = static_cast<uint32_t>(n);
        bits |= b;
    }
    slice_bits[s][q] = bits;
    __syncthreads();
    // Word w of the block: groups 4w .. 4w + 3, eight bits each.
    if (threadIdx.x < GROUPS / 4) {
        const int w = threadIdx.x;
        uint32_t word = 0;
        for (int k = 0; k < 4; ++k) {
            uint32_t g = 0;
            for (int sl = 0; sl < SLICES; ++sl) g |= slice_bits[sl][4 * w + k];
            word |= g << (8 * k);
        }
        const int word_col = c0 + 32 * w;
        const int n_words = (f + 31) / 32;
        if (word_col < f) words[static_cast<long long>(tt) * n_words + word_col / 32] = word;
    }
    const int t0 = c0 / tile;
    for (int i = threadIdx.x; i < rows * tiles_here; i += blockDim.x) {
        const int r = i / tiles_here, t = i % tiles_here;
        if (t0 + t < n_tiles) counts[(r0 + r) * n_tiles + t0 + t] = tile_counts[r][t];
    }
}

// One block per token tile: the union's neurons in column order ([n_token_tiles, f]) and
// how many there are, from the bits kernel's words by a block-wide prefix sum of their
// counts, 256 words at a time.
extern "C" __global__ void __launch_bounds__(256) twell_union_list(
    const uint32_t* __restrict__ words,  // [n_token_tiles, ceil(f / 32)]
    int* __restrict__ list,              // [n_token_tiles, f]
    int* __restrict__ list_len,          // [n_token_tiles]
    int f) {
    __shared__ int warp_sums[8];
    const int tt = blockIdx.x;
    const int n_words = (f + 31) / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int* out = list + static_cast<long long>(tt) * f;
    int offset = 0;
    for (int w0 = 0; w0 < n_words; w0 += 256) {
        const int w = w0 + threadIdx.x;
        const uint32_t word = w < n_words ? words[static_cast<long long>(tt) * n_words + w] : 0u;
        const int n = __popc(word);
        // Inclusive sum within the warp, then across the warps.
        const int incl = warp_inclusive_sum(n);
        if (lane == 31) warp_sums[warp] = incl;
        __syncthreads();
        int before = 0, total = 0;
        for (int k = 0; k < 8; ++k) {
            if (k < warp) before += warp_sums[k];
            total += warp_sums[k];
        }
        int at = offset + before + incl - n;
        uint32_t rest = word;
        while (rest) {
            const int b = __ffs(rest) - 1;
            rest &= rest - 1;
            out[at++] = 32 * w + b;
        }
        offset += total;
        __syncthreads();  // warp_sums is read before the next round writes it
    }
    if (threadIdx.x == 0) list_len[tt] = offset;
}

// Shared memory of a pipeline stage's tiles, padded rows (`PAD`).
template <int ROWS, int COLS>
struct StageTile {
    __nv_bfloat16 (*at)[ROWS][COLS + PAD];
    __device__ __forceinline__ __nv_bfloat16* operator()(int buf, int r, int c) const { return &at[buf][r][c]; }
};

// acc = 0 for a warp's 2 x NT tiles of m16n8.
template <int NT>
__device__ __forceinline__ void zero_tiles(float (&acc)[2][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
}

// One K_STEP of a warp's products: acc += A · B for its 32 tokens (wm·32 ..) of the stage's
// A tile `as` (row-major fragments by ldmatrix) and its NT n-tiles, whose fragments
// `b_pair(kk, np, b)` loads for n-tiles 2np and 2np + 1 at k-step kk (b[0], b[1] and b[2],
// b[3]). Up and down differ only in how B is laid out.
template <int NT, class BPair>
__device__ __forceinline__ void mma_stage(float (&acc)[2][NT][4], const StageTile<UNION_TOKENS, K_STEP>& as, int buf,
                                          int wm, int lane, BPair b_pair) {
#pragma unroll
    for (int kk = 0; kk < K_STEP / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
            ldmatrix_x4(a[mt], as(buf, wm * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            b_pair(kk, np, b);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                mma_16816(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma_16816(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// The up projection over a token tile's union: block (tile, b) multiplies the tile's
// tokens by union members b·NB .. + NB (rows of Wu gathered by the list), K_STEP of d at
// a time through a STAGES-deep cp.async pipeline; eight warps, two along the tokens and
// four along the members, 32 x NB/4 each. Writes h as [M, f] rows whose column k is union
// member k (zeros from the union's length to the block's end, so the down kernel's last
// k-step reads zeros), and the block's Σ|h| of each token to l1_parts[token, b] (summed
// over the warps in order: deterministic).
template <int NB>
__device__ void union_up(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,
                         const __nv_bfloat16* __restrict__ gate, const int* __restrict__ list,
                         const int* __restrict__ list_len, __nv_bfloat16* __restrict__ h,
                         float* __restrict__ l1_parts, int M, int d, int f) {
    constexpr int NT = NB / 4 / 8;  // a warp's n-tiles of 8 members
    extern __shared__ __align__(16) unsigned char union_smem[];
    const StageTile<UNION_TOKENS, K_STEP> xs{reinterpret_cast<__nv_bfloat16(*)[UNION_TOKENS][K_STEP + PAD]>(union_smem)};
    const StageTile<NB, K_STEP> ws{reinterpret_cast<__nv_bfloat16(*)[NB][K_STEP + PAD]>(
        union_smem + STAGES * UNION_TOKENS * (K_STEP + PAD) * 2)};
    __shared__ int neuron[NB];
    __shared__ float l1_warps[4][UNION_TOKENS];
    const int tt = blockIdx.x, nb = blockIdx.y;
    const int len = list_len[tt];
    const int n0 = nb * NB;
    if (n0 >= len) return;  // the whole block: nothing of the union here
    const long long r0 = static_cast<long long>(tt) * UNION_TOKENS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;  // the fragment row and column pair of this lane
    const int wm = warp >> 2, wn = warp & 3;
    for (int i = threadIdx.x; i < NB; i += UNION_THREADS)
        neuron[i] = n0 + i < len ? list[static_cast<long long>(tt) * f + n0 + i] : -1;
    __syncthreads();

    // Copies of a stage: x's 64 rows x 4 pieces of 16 bytes, a piece a thread; Wu's NB
    // rows x 4 pieces, NB / 64 a thread (rows a_row + 64i). Rows past M or the union are
    // zeros.
    constexpr int W_PIECES = NB / 64;
    const int a_row = threadIdx.x >> 2, piece = (threadIdx.x & 3) * VEC;
    const bool x_ok = r0 + a_row < M;
    const __nv_bfloat16* x_src = x + (x_ok ? (r0 + a_row) * d : 0) + piece;
    const __nv_bfloat16* w_src[W_PIECES];
    bool w_ok[W_PIECES];
#pragma unroll
    for (int i = 0; i < W_PIECES; ++i) {
        const int j = neuron[a_row + 64 * i];
        w_ok[i] = j >= 0;
        w_src[i] = w_ud + (j >= 0 ? static_cast<long long>(j) * 2 * d : 0) + piece;
    }
    auto stage = [&](int buf, int k0) {
        copy16_async(xs(buf, a_row, piece), x_src + k0, x_ok);
#pragma unroll
        for (int i = 0; i < W_PIECES; ++i) copy16_async(ws(buf, a_row + 64 * i, piece), w_src[i] + k0, w_ok[i]);
    };

    float acc[2][NT][4];
    zero_tiles(acc);
    const int steps = d / K_STEP;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) stage(s, s * K_STEP);
        async_commit();  // an empty group past the end keeps the wait counts right
    }
    for (int ks = 0; ks < steps; ++ks) {
        async_wait<STAGES - 2>();  // step ks's copies (this thread's) have landed
        __syncthreads();           // ... everyone's; and step ks - 1's buffer is free
        const int next = ks + STAGES - 1;
        if (next < steps) stage(next % STAGES, next * K_STEP);
        async_commit();
        const int buf = ks % STAGES;
        mma_stage(acc, xs, buf, wm, lane, [&](int kk, int np, uint32_t(&b)[4]) {
            // Matrices: members of n-tiles 2np and 2np + 1, k kk·16 and kk·16 + 8.
            ldmatrix_x4(b, ws(buf, wn * (NB / 4) + (2 * np + (lane >> 4)) * 8 + (lane & 7), kk * 16 + ((lane >> 3) & 1) * 8));
        });
    }
    async_wait<0>();

    // h for each accumulator: element e of tile (mt, nt) is token wm·32 + mt·16 + g + 8·(e >> 1),
    // member wn·NB/4 + nt·8 + 2c + (e & 1) of the block. A row's 2·NT gate values are
    // loaded first, unconditionally (a row past M reads row r0, a member past the union
    // neuron 0, both discarded): loads behind their own branches would wait for L2 one
    // at a time.
    float l1[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const long long row = r0 + wm * 32 + mt * 16 + g + 8 * half;
            const bool row_ok = row < M;
            const __nv_bfloat16* gate_row = gate + (row_ok ? row : r0) * f;
            int j[NT][2];
            __nv_bfloat16 gq[NT][2];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    j[nt][e] = neuron[wn * (NB / 4) + nt * 8 + 2 * c + e];
                    gq[nt][e] = gate_row[max(j[nt][e], 0)];
                }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int k_local = wn * (NB / 4) + nt * 8 + 2 * c;
                float hv[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float gv = __bfloat162float(gq[nt][e]);
                    hv[e] = j[nt][e] >= 0 && gv > 0.f ? round_bf16(gv * acc[mt][nt][2 * half + e]) : 0.f;
                    l1[mt][half] += fabsf(hv[e]);
                }
                // f % 8 == 0: the pair is inside or past f.
                if (row_ok && n0 + k_local < f)
                    *reinterpret_cast<__nv_bfloat162*>(h + row * f + n0 + k_local) = __floats2bfloat162_rn(hv[0], hv[1]);
            }
        }
    }
    // The four lanes of a fragment row hold its columns: sum them, then the four warps
    // along the members in order.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float v = l1[mt][half];
            v += __shfl_xor_sync(FULL_MASK, v, 1);
            v += __shfl_xor_sync(FULL_MASK, v, 2);
            if (c == 0) l1_warps[wn][wm * 32 + mt * 16 + g + 8 * half] = v;
        }
    __syncthreads();
    if (threadIdx.x < UNION_TOKENS && r0 + threadIdx.x < M) {
        const int n_blocks = (f + NB - 1) / NB;
        const float sum = ((l1_warps[0][threadIdx.x] + l1_warps[1][threadIdx.x]) + l1_warps[2][threadIdx.x]) +
                          l1_warps[3][threadIdx.x];
        l1_parts[(r0 + threadIdx.x) * n_blocks + nb] = sum;
    }
}

// The down projection over a token tile's union: block (tile, b) writes output columns
// b·NB .. + NB of the tile's tokens, summing over the union K_STEP members at a time (h's
// columns, and the gathered rows of Wd), eight warps of 32 x NB/4; then, in the blocks of
// the first columns, each token's L1 term from the up blocks' sums (blocks of `up_nb`) in
// order.
template <int NB>
__device__ void union_down(const __nv_bfloat16* __restrict__ w_ud, const int* __restrict__ list,
                           const int* __restrict__ list_len, const __nv_bfloat16* __restrict__ h,
                           const float* __restrict__ l1_parts, __nv_bfloat16* __restrict__ out, int M, int d,
                           int f, int up_nb) {
    constexpr int NT = NB / 4 / 8;
    extern __shared__ __align__(16) unsigned char union_smem[];
    const StageTile<UNION_TOKENS, K_STEP> hs{reinterpret_cast<__nv_bfloat16(*)[UNION_TOKENS][K_STEP + PAD]>(union_smem)};
    const StageTile<K_STEP, NB> ws{reinterpret_cast<__nv_bfloat16(*)[K_STEP][NB + PAD]>(
        union_smem + STAGES * UNION_TOKENS * (K_STEP + PAD) * 2)};
    const int tt = blockIdx.x, cb = blockIdx.y;
    const int len = list_len[tt];
    // h holds zeros from the union's length up to its up block's end (a multiple of 8).
    const int len8 = (len + VEC - 1) / VEC * VEC;
    const int c0 = cb * NB;
    const long long r0 = static_cast<long long>(tt) * UNION_TOKENS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;
    const int* tile_list = list + static_cast<long long>(tt) * f;

    // Copies of a stage: h's 64 rows x 4 pieces, a piece a thread; Wd's K_STEP rows x
    // NB / 8 pieces, W_PIECES a thread (rows b_row + ROW_STEP·i).
    constexpr int ROW_PIECES = NB / VEC;
    constexpr int ROW_STEP = UNION_THREADS / ROW_PIECES;
    constexpr int W_PIECES = K_STEP / ROW_STEP;
    const int a_row = threadIdx.x >> 2, a_piece = (threadIdx.x & 3) * VEC;
    const bool h_row_ok = r0 + a_row < M;
    const __nv_bfloat16* h_src = h + (h_row_ok ? (r0 + a_row) * f : 0) + a_piece;
    const int b_row = threadIdx.x / ROW_PIECES, b_piece = (threadIdx.x % ROW_PIECES) * VEC;
    const bool col_ok = c0 + b_piece < d;
    const __nv_bfloat16* wd = w_ud + d + c0 + (col_ok ? b_piece : 0);
    // The neurons of this thread's Wd rows of a stage, read a stage ahead of their
    // copies: a copy whose address waited on its neuron's load would hold the warp for
    // an L2 round trip before its products.
    auto neurons_of = [&](int k0, int (&j)[W_PIECES]) {
#pragma unroll
        for (int i = 0; i < W_PIECES; ++i) {
            const int k = k0 + b_row + ROW_STEP * i;
            j[i] = col_ok && k < len ? tile_list[k] : -1;
        }
    };
    auto stage = [&](int buf, int k0, const int (&j)[W_PIECES]) {
        const bool h_ok = h_row_ok && k0 + a_piece < len8;
        copy16_async(hs(buf, a_row, a_piece), h_ok ? h_src + k0 : h, h_ok);
#pragma unroll
        for (int i = 0; i < W_PIECES; ++i) {
            const bool ok = j[i] >= 0;
            const __nv_bfloat16* src = ok ? wd + static_cast<long long>(j[i]) * 2 * d : w_ud;
            copy16_async(ws(buf, b_row + ROW_STEP * i, b_piece), src, ok);
        }
    };

    float acc[2][NT][4];
    zero_tiles(acc);
    const int steps = (len + K_STEP - 1) / K_STEP;
    int j_next[W_PIECES];  // the neurons of step `next`'s rows, loaded a step ahead
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        neurons_of(s * K_STEP, j_next);
        if (s < steps) stage(s, s * K_STEP, j_next);
        async_commit();
    }
    neurons_of((STAGES - 1) * K_STEP, j_next);
    for (int ks = 0; ks < steps; ++ks) {
        async_wait<STAGES - 2>();
        __syncthreads();
        const int next = ks + STAGES - 1;
        if (next < steps) stage(next % STAGES, next * K_STEP, j_next);
        async_commit();
        neurons_of((next + 1) * K_STEP, j_next);
        const int buf = ks % STAGES;
        mma_stage(acc, hs, buf, wm, lane, [&](int kk, int np, uint32_t(&b)[4]) {
            // Matrices: members kk·16 + 0-7 and + 8-15, at columns np·16 and np·16 + 8.
            ldmatrix_x4_trans(b, ws(buf, kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, wn * (NB / 4) + np * 16 + (lane >> 4) * 8));
        });
    }
    async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const long long row = r0 + wm * 32 + mt * 16 + g + 8 * half;
            if (row >= M) continue;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = c0 + wn * (NB / 4) + nt * 8 + 2 * c;
                if (col < d)  // d % 8 == 0: the pair is inside or past d
                    *reinterpret_cast<__nv_bfloat162*>(out + row * d + col) =
                        __floats2bfloat162_rn(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
            }
        }
    if (cb == 0 && threadIdx.x < UNION_TOKENS && r0 + threadIdx.x < M) {
        const long long row = r0 + threadIdx.x;
        const int n_blocks = (f + up_nb - 1) / up_nb;
        const int used = (len + up_nb - 1) / up_nb;  // the up blocks that ran
        float sum = 0.f;
        for (int b = 0; b < used; ++b) sum += l1_parts[row * n_blocks + b];
        out[l1_at(M, d, row)] = __float2bfloat16(sum);
    }
}

// One entry point per block width: `twell_union_up_bf16_n{NB}`, `twell_union_down_bf16_n{NB}`.
// MIN_BLOCKS: blocks an SM must hold (NB 256: two, at most 128 registers; unbounded the
// up kernel's epilogue took 156, one block an SM).
#define UNION_KERNELS(NB, MIN_BLOCKS)                                                                             \
    extern "C" __global__ void __launch_bounds__(UNION_THREADS, MIN_BLOCKS) twell_union_up_bf16_n##NB(  \
        const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_ud,                   \
        const __nv_bfloat16* __restrict__ gate, const int* __restrict__ list,                          \
        const int* __restrict__ list_len, __nv_bfloat16* __restrict__ h, float* __restrict__ l1_parts, \
        int M, int d, int f) {                                                                          \
        union_up<NB>(x, w_ud, gate, list, list_len, h, l1_parts, M, d, f);                              \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(UNION_THREADS, MIN_BLOCKS) twell_union_down_bf16_n##NB(\
        const __nv_bfloat16* __restrict__ w_ud, const int* __restrict__ list,                          \
        const int* __restrict__ list_len, const __nv_bfloat16* __restrict__ h,                         \
        const float* __restrict__ l1_parts, __nv_bfloat16* __restrict__ out, int M, int d, int f,      \
        int up_nb) {                                                                                    \
        union_down<NB>(w_ud, list, list_len, h, l1_parts, out, M, d, f, up_nb);                         \
    }
UNION_KERNELS(128, 1)
UNION_KERNELS(256, 2)

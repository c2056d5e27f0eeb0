// causal_attention: softmax(q kᵀ / sqrt(hd) + causal mask) v in one pass, for prefill.
//
// The plain-op attention materialises the [b, heads, t, T] f32 scores and runs a dozen
// elementwise kernels over them; at 4 x 2048 tokens that is 24 ms a layer on an H200.
// Here the scores never leave registers (online softmax, as in FlashAttention): one
// thread owns one query row (q and the output accumulator in registers), a block of
// QUERIES threads walks the keys in tiles staged through shared memory, and every
// thread reads each staged key and value by broadcast.
//
// Query i of the block sits at absolute position past + i and attends keys 0 ..= past + i
// (past = T - t: the KV cache before this call). Grouped-query attention: head h reads
// KV head h / (heads / kv_heads). bf16 in and out, f32 math.
//
// One query per (batch, head) (KV-cache decode) leaves that layout with one busy thread
// per block, so it has its own kernel below: a block per (batch, head) spreads the keys
// over its threads.
#include "twell_common.cuh"

#define QUERIES 64
#define KEYS 64
// Keys scored at once before the running maximum is updated: one rescale of the
// accumulator per chunk instead of per key.
#define CHUNK 16

template <int HD>
__device__ void attend(const __nv_bfloat16* __restrict__ q,  // [b, heads, t, HD]
                       const __nv_bfloat16* __restrict__ k,  // [b, kv_heads, T, HD]
                       const __nv_bfloat16* __restrict__ v,  // [b, kv_heads, T, HD]
                       __nv_bfloat16* __restrict__ out,      // [b, heads, t, HD]
                       int heads, int kv_heads, int t, int T, float scale) {
    __shared__ float ks[KEYS][HD];
    __shared__ float vs[KEYS][HD];
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (heads / kv_heads);
    const int past = T - t;
    const int q0 = blockIdx.x * QUERIES;
    const int qi = q0 + threadIdx.x;
    const bool live = qi < t;
    const long long q_row = ((static_cast<long long>(b) * heads + h) * t + (live ? qi : 0)) * HD;
    const long long kv_base = (static_cast<long long>(b) * kv_heads + kvh) * T * HD;

    float qr[HD], acc[HD];
#pragma unroll
    for (int e = 0; e < HD; ++e) {
        qr[e] = live ? __bfloat162float(q[q_row + e]) * scale : 0.f;
        acc[e] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    const int last_key = past + min(q0 + QUERIES, t) - 1;  // the block's furthest key
    const int my_last = past + qi;                         // this thread's furthest key
    for (int k0 = 0; k0 <= last_key; k0 += KEYS) {
        const int n = min(KEYS, last_key + 1 - k0);
        __syncthreads();
        for (int idx = threadIdx.x; idx < n * HD; idx += QUERIES) {
            const int r = idx / HD, c = idx % HD;
            ks[r][c] = __bfloat162float(k[kv_base + static_cast<long long>(k0 + r) * HD + c]);
            vs[r][c] = __bfloat162float(v[kv_base + static_cast<long long>(k0 + r) * HD + c]);
        }
        __syncthreads();
        if (!live) continue;
        const int visible = min(n, my_last + 1 - k0);  // keys of this tile this row sees
        for (int c0 = 0; c0 < visible; c0 += CHUNK) {
            float s[CHUNK];
            float chunk_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) {
                float dot = -INFINITY;
                if (c0 + j < visible) {
                    dot = 0.f;
#pragma unroll
                    for (int e = 0; e < HD; ++e) dot = fmaf(qr[e], ks[c0 + j][e], dot);
                }
                s[j] = dot;
                chunk_max = fmaxf(chunk_max, dot);
            }
            const float m_new = fmaxf(m, chunk_max);
            const float correction = __expf(m - m_new);  // 0 on the first chunk
            l *= correction;
#pragma unroll
            for (int e = 0; e < HD; ++e) acc[e] *= correction;
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) {
                const float p = __expf(s[j] - m_new);  // 0 for keys past `visible`
                l += p;
                if (c0 + j < visible) {
#pragma unroll
                    for (int e = 0; e < HD; ++e) acc[e] = fmaf(p, vs[c0 + j][e], acc[e]);
                }
            }
            m = m_new;
        }
    }
    if (live) {
        const float inv = 1.f / l;
#pragma unroll
        for (int e = 0; e < HD; ++e) out[q_row + e] = __float2bfloat16(acc[e] * inv);
    }
}

#define ATTEND_KERNEL(HD)                                                                         \
    extern "C" __global__ void __launch_bounds__(QUERIES) causal_attention_bf16_hd##HD(           \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                 \
        const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, int heads,          \
        int kv_heads, int t, int T, float scale) {                                                \
        attend<HD>(q, k, v, out, heads, kv_heads, t, T, scale);                                   \
    }
ATTEND_KERNEL(64)

// Decode: one query row per (batch, head), attending all T keys. A block of
// DECODE_THREADS per (batch, head): a thread per key scores into shared memory, the block
// reduces the maximum and the sum, then each thread sums p · v for a pair of dims over
// its share of the keys, and the shares meet in shared memory.
#define DECODE_THREADS 256

template <int HD>
__device__ void attend_one(const __nv_bfloat16* __restrict__ q,  // [b, heads, 1, HD]
                           const __nv_bfloat16* __restrict__ k,  // [b, kv_heads, T, HD]
                           const __nv_bfloat16* __restrict__ v,  // [b, kv_heads, T, HD]
                           __nv_bfloat16* __restrict__ out,      // [b, heads, 1, HD]
                           int heads, int kv_heads, int T, float scale) {
    extern __shared__ float scores[];  // [T]
    __shared__ float qs[HD];
    __shared__ float reduce[DECODE_THREADS / 32];
    constexpr int PAIRS = HD / 2;
    constexpr int GROUPS = DECODE_THREADS / PAIRS;
    __shared__ float2 part[GROUPS][PAIRS];
    const int h = blockIdx.x, b = blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long q_row = (static_cast<long long>(b) * heads + h) * HD;
    const long long kv_base = (static_cast<long long>(b) * kv_heads + kvh) * T * HD;
    for (int e = tid; e < HD; e += DECODE_THREADS) qs[e] = __bfloat162float(q[q_row + e]) * scale;
    __syncthreads();

    float m = -INFINITY;
    for (int j = tid; j < T; j += DECODE_THREADS) {
        const __nv_bfloat16* kr = k + kv_base + static_cast<long long>(j) * HD;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < HD; e += VEC) {
            float kf[VEC];
            load8(kr + e, kf);
#pragma unroll
            for (int c = 0; c < VEC; ++c) s = fmaf(qs[e + c], kf[c], s);
        }
        scores[j] = s;
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
    for (int j = tid; j < T; j += DECODE_THREADS) {
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

    const int pair = tid % PAIRS, group = tid / PAIRS;
    const __nv_bfloat16* vp = v + kv_base + 2 * pair;
    float2 acc = make_float2(0.f, 0.f);
#pragma unroll 4
    for (int j = group; j < T; j += GROUPS) {
        const float2 vf =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(vp + static_cast<long long>(j) * HD));
        const float p = scores[j];
        acc.x = fmaf(p, vf.x, acc.x);
        acc.y = fmaf(p, vf.y, acc.y);
    }
    part[group][pair] = acc;
    __syncthreads();
    if (tid < PAIRS) {
        float2 o = make_float2(0.f, 0.f);
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            o.x += part[g][tid].x;
            o.y += part[g][tid].y;
        }
        const float inv = 1.f / l;
        *reinterpret_cast<__nv_bfloat162*>(out + q_row + 2 * tid) = __floats2bfloat162_rn(o.x * inv, o.y * inv);
    }
}

#define ATTEND_ONE_KERNEL(HD)                                                                     \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) causal_attention_decode_bf16_hd##HD( \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                 \
        const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, int heads,          \
        int kv_heads, int T, float scale) {                                                       \
        attend_one<HD>(q, k, v, out, heads, kv_heads, T, scale);                                  \
    }
ATTEND_ONE_KERNEL(64)

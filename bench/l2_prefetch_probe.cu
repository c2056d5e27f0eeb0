// Does prefetching the next kernel's weights into L2 shorten a chain of decode-sized kernels?
// A one-row decode step stand-in: per layer, gemv qkv -> attention stand-in -> gemv o -> gemv gate,
// captured once as a CUDA graph and replayed. Variants:
//   0 none
//   1 each kernel prefetches the next kernel's weights at its start
//   2 each kernel prefetches after its own first loads are in flight
//   3 as 1 with prefetch.global.L2::evict_last
//   4 side stream: a small prefetch kernel forked beside the chain
// nvcc -O3 -arch=sm_90 -o probe l2_prefetch_probe.cu
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at line %d\n", cudaGetErrorString(e_), __LINE__); exit(1);} } while (0)

struct Prefetch { const char* p; unsigned long long bytes; };

template <int MODE>
__device__ __forceinline__ void prefetch_share(Prefetch pf) {
    if (pf.p == nullptr) return;
    const unsigned long long lines = pf.bytes / 128;
    const unsigned long long n = (unsigned long long)gridDim.x * gridDim.y * blockDim.x;
    const unsigned long long t = ((unsigned long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    for (unsigned long long i = t; i < lines; i += n) {
        if (MODE == 3) asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(pf.p + i * 128));
        else asm volatile("prefetch.global.L2 [%0];" ::"l"(pf.p + i * 128));
    }
}

__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
    const __nv_bfloat162* ah = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float2 x = __bfloat1622float2(ah[q]), y = __bfloat1622float2(bh[q]);
        acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
    }
    return acc;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// y = W x, a warp a row, one wave of blocks, the next row's loads in flight.
template <int U>
__global__ void __launch_bounds__(256) gemv(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                            __nv_bfloat16* __restrict__ y, int n, int k, Prefetch pf, int mode) {
    if (mode == 1) prefetch_share<1>(pf);
    if (mode == 3) prefetch_share<3>(pf);
    const int lane = threadIdx.x & 31, vecs = k / 8;
    const long long warps = (long long)gridDim.x * 8;
    long long r = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    uint4 cur[U], nxt[U];
    auto load = [&](long long row, uint4* b) {
        const uint4* wr = reinterpret_cast<const uint4*>(w + row * k);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = lane + 32 * u;
            b[u] = (row < n && v < vecs) ? __ldcs(wr + v) : make_uint4(0, 0, 0, 0);
        }
    };
    load(r, cur);
    if (mode == 2) prefetch_share<2>(pf);
    for (; r < n; r += warps) {
        load(r + warps, nxt);
        float acc = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = lane + 32 * u;
            if (v < vecs) acc = dot8(cur[u], __ldg(reinterpret_cast<const uint4*>(x) + v), acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) y[r] = __float2bfloat16(acc);
#pragma unroll
        for (int u = 0; u < U; ++u) cur[u] = nxt[u];
    }
}

// Attention stand-in: block (head, split) reads its keys, reduces, then (dependent) its values.
__global__ void __launch_bounds__(128) attend(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                                              __nv_bfloat16* __restrict__ out, int ctx, int kv_heads, int hd, Prefetch pf, int mode) {
    if (mode == 1) prefetch_share<1>(pf);
    if (mode == 3) prefetch_share<3>(pf);
    const int head = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int kvh = head % kv_heads, width = 2 * kv_heads * hd;
    const int per = (ctx + splits - 1) / splits, p0 = split * per, p1 = min(ctx, p0 + per);
    __shared__ float score[1024];
    __shared__ float red[4];
    // keys: a thread a position, hd elements
    float m = -1e30f;
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
        const __nv_bfloat16* key = kv + (long long)p * width + kvh * hd;
        float s = 0.f;
        for (int i = 0; i < hd; i += 8)
            s = dot8(*reinterpret_cast<const uint4*>(key + i), *reinterpret_cast<const uint4*>(q + head * hd + i), s);
        score[p - p0] = s;
        m = fmaxf(m, s);
    }
    if (mode == 2) prefetch_share<2>(pf);
    m = warp_sum(m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    const float scale = 1e-3f * (red[0] + red[1] + red[2] + red[3]);
    // values: dependent on the keys' pass
    float acc = 0.f;
    const int dim = threadIdx.x % hd;
    for (int p = p0 + threadIdx.x / hd; p < p1; p += blockDim.x / hd)
        acc += (score[p - p0] * scale) * __bfloat162float(kv[(long long)p * width + kv_heads * hd + kvh * hd + dim]);
    out[(head * splits + split) * 128 + threadIdx.x] = __float2bfloat16(acc);
}

// A standalone prefetch kernel (the side-stream variant).
__global__ void prefetch_kernel(Prefetch a, Prefetch b) {
    prefetch_share<1>(a);
    prefetch_share<1>(b);
}

struct Shape { const char* name; int d, qkv, ff, layers, heads, kv_heads; };

int main(int argc, char** argv) {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("card %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    const Shape shapes[] = {
        {"1.5B 2048x5632x28", 2048, 6144, 5632, 28, 32, 32},
        {"SmolLM2 576x1536x30", 576, 960, 1536, 30, 9, 3},
        {"Llama-3.2-1B 2048x8192x16", 2048, 3072, 8192, 16, 32, 8},
        {"8B 4096x14336x32", 4096, 6144, 14336, 32, 32, 8},
    };
    const int ctx = 512, hd = 64;
    for (const Shape& s : shapes) {
        const int hdim = (s.d == 4096) ? 128 : hd;
        const size_t wq = (size_t)s.qkv * s.d, wo = (size_t)s.d * s.d, wg = (size_t)s.ff * s.d;
        const size_t kvn = (size_t)ctx * 2 * s.kv_heads * hdim;
        std::vector<__nv_bfloat16*> Wq(s.layers), Wo(s.layers), Wg(s.layers), KV(s.layers);
        for (int l = 0; l < s.layers; ++l) {
            CK(cudaMalloc(&Wq[l], wq * 2)); CK(cudaMemset(Wq[l], 0x3c, wq * 2));
            CK(cudaMalloc(&Wo[l], wo * 2)); CK(cudaMemset(Wo[l], 0x3c, wo * 2));
            CK(cudaMalloc(&Wg[l], wg * 2)); CK(cudaMemset(Wg[l], 0x3c, wg * 2));
            CK(cudaMalloc(&KV[l], kvn * 2)); CK(cudaMemset(KV[l], 0x3c, kvn * 2));
        }
        __nv_bfloat16 *x, *y, *att;
        CK(cudaMalloc(&x, 65536 * 2)); CK(cudaMemset(x, 0x3c, 65536 * 2));
        CK(cudaMalloc(&y, 65536 * 2));
        CK(cudaMalloc(&att, 1 << 20));
        int occ = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, gemv<8>, 256, 0));
        const int wave = occ * sms;
        auto blocks = [&](int n) { return std::min((n + 7) / 8, wave); };
        const int splits = std::max(1, (2 * sms) / s.heads);
        cudaStream_t st, side;
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
        std::vector<cudaEvent_t> ev(4 * s.layers + 2);
        for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        printf("\n%s: weights %.1f MB a layer, gemv occupancy %d blocks/SM, attention %dx%d blocks\n", s.name,
               (wq + wo + wg) * 2 / 1e6, occ, s.heads, splits);
        auto pf = [&](const __nv_bfloat16* p, size_t n) { return Prefetch{reinterpret_cast<const char*>(p), n * 2 / 128 * 128}; };
        auto gv = [&](const __nv_bfloat16* W, int n, int k, Prefetch p, int mode) {
            if (k <= 512) gemv<2><<<blocks(n), 256, 0, st>>>(x, W, y, n, k, p, mode);
            else if (k <= 1024) gemv<4><<<blocks(n), 256, 0, st>>>(x, W, y, n, k, p, mode);
            else if (k <= 2048) gemv<8><<<blocks(n), 256, 0, st>>>(x, W, y, n, k, p, mode);
            else gemv<16><<<blocks(n), 256, 0, st>>>(x, W, y, n, k, p, mode);
        };
        const Prefetch none{nullptr, 0};
        for (int mode : {0, 1, 2, 3, 4, 0, 1, 2}) {
            const int km = mode == 4 ? 0 : mode;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            int e = 0;
            for (int l = 0; l < s.layers; ++l) {
                const int ln = (l + 1) % s.layers;
                gv(Wq[l], s.qkv, s.d, km ? pf(Wo[l], wo) : none, km);
                if (mode == 4) {
                    CK(cudaEventRecord(ev[e], st)); CK(cudaStreamWaitEvent(side, ev[e++], 0));
                    prefetch_kernel<<<sms, 128, 0, side>>>(pf(Wo[l], wo), pf(Wg[l], wg));
                }
                attend<<<dim3(s.heads, splits), 128, 0, st>>>(x, KV[l], att, ctx, s.kv_heads, hdim, km ? pf(Wg[l], wg) : none, km);
                gv(Wo[l], s.d, s.d, none, km);
                if (mode == 4) {
                    CK(cudaEventRecord(ev[e], st)); CK(cudaStreamWaitEvent(side, ev[e++], 0));
                    prefetch_kernel<<<sms, 128, 0, side>>>(pf(Wq[ln], wq), none);
                }
                gv(Wg[l], s.ff, s.d, km ? pf(Wq[ln], wq) : none, km);
            }
            if (mode == 4) { CK(cudaEventRecord(ev[e], side)); CK(cudaStreamWaitEvent(st, ev[e++], 0)); }
            cudaGraph_t g;
            CK(cudaStreamEndCapture(st, &g));
            cudaGraphExec_t ge;
            CK(cudaGraphInstantiate(&ge, g, 0));
            for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, st));
            cudaEvent_t a, b;
            CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
            std::vector<float> t;
            for (int rep = 0; rep < 7; ++rep) {
                CK(cudaEventRecord(a, st));
                for (int i = 0; i < 30; ++i) CK(cudaGraphLaunch(ge, st));
                CK(cudaEventRecord(b, st));
                CK(cudaEventSynchronize(b));
                float ms; CK(cudaEventElapsedTime(&ms, a, b));
                t.push_back(ms * 1000.f / 30.f);
            }
            std::sort(t.begin(), t.end());
            const double bytes = (double)(wq + wo + wg + kvn) * 2 * s.layers;
            printf("  mode %d: step %.1f us (median of 7; min %.1f), %.1f us a layer, %.2f TB/s\n", mode, t[3], t[0],
                   t[3] / s.layers, bytes / (t[3] * 1e-6) / 1e12);
            CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
        }
        CK(cudaDeviceSynchronize());
        for (int l = 0; l < s.layers; ++l) { cudaFree(Wq[l]); cudaFree(Wo[l]); cudaFree(Wg[l]); cudaFree(KV[l]); }
        cudaFree(x); cudaFree(y); cudaFree(att);
    }
    return 0;
}

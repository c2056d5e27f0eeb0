// Stand-in of a one-row decode step: per layer a q/k/v GEMV, an attention-like pass over
// cached rows with a last-block merge, an output GEMV and an MLP-like kernel (gate GEMV,
// then the active rows, then a last-block sum). Captured as a CUDA graph and replayed,
// plainly and as programmatic dependent launches (each kernel loads its first weight rows,
// may let its dependents launch, then waits), with and without stream-ordered allocation
// nodes between the kernels (what a candle step captures). It also counts the captured
// graph's programmatic edges.
//
//   nvcc -arch=sm_90 -O3 -std=c++17 -o probe bench/programmatic_edges_probe.cu && ./probe
//
// Result on an H100 (docs/results/gpu/h100/decode-step-standin-programmatic-edges-probe.txt):
// with allocation nodes in between, the capture makes no programmatic edge at all and
// the step times equal plain launches; without them every kernel edge is programmatic,
// and letting dependents launch early gives 1.26-1.29x (SmolLM2 shape) and 1.16-1.18x
// (1.5B shape).
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1);} } while (0)

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ float dot2(uint32_t a, uint32_t b) {
    __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&a), y = *reinterpret_cast<__nv_bfloat162*>(&b);
    float2 fx = __bfloat1622float2(x), fy = __bfloat1622float2(y);
    return fx.x * fy.x + fx.y * fy.y;
}
__device__ __forceinline__ float wsum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// MODE 0: y[r] = W[r] . x. MODE 1 (attention-like): then the last block sums y into out[k].
// MODE 2 (MLP-like): rows with r % 33 == 0 and y_r > -inf are active: u = Wu[r] . x, then
// acc += y_r u Wd[r] (f32 atomics), then the last block writes out = bf16(acc) and zeroes acc.
template <int KW, int PF, int MODE>
__global__ void __launch_bounds__(256) layer_kernel(const uint32_t* __restrict__ W, const uint32_t* __restrict__ Wud,
                                                    int rows, int active_mod, const __nv_bfloat16* x_in, __nv_bfloat16* y,
                                                    __nv_bfloat16* out, float* acc, unsigned* ticket, int trigger) {
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int nwarps = gridDim.x * 8;
    constexpr int kw = KW * 32;
    uint32_t pre[PF][KW];
#pragma unroll
    for (int p = 0; p < PF; ++p) {
        const int r = warp + p * nwarps;
#pragma unroll
        for (int i = 0; i < KW; ++i) pre[p][i] = r < rows ? __ldg(W + (long long)r * kw + i * 32 + lane) : 0u;
    }
    if (trigger) pdl_trigger();
    pdl_wait();
    uint32_t xr[KW];
    const uint32_t* xw = reinterpret_cast<const uint32_t*>(x_in);
#pragma unroll
    for (int i = 0; i < KW; ++i) xr[i] = xw[i * 32 + lane];
    auto finish_row = [&](int r, float s) {
        s = wsum(s);
        if (MODE == 2 && (r % active_mod) == 0 && s > -1e30f) {
            float u = 0.f;
            for (int i = 0; i < KW; ++i) u += dot2(Wud[(long long)r * 2 * kw + i * 32 + lane], xr[i]);
            u = wsum(u) * s * 1e-3f;
            for (int i = 0; i < KW; ++i) {
                const uint32_t wd = Wud[(long long)r * 2 * kw + kw + i * 32 + lane];
                __nv_bfloat162 wv = *reinterpret_cast<const __nv_bfloat162*>(&wd);
                float2 f = __bfloat1622float2(wv);
                atomicAdd(acc + 2 * (i * 32 + lane), u * f.x);
                atomicAdd(acc + 2 * (i * 32 + lane) + 1, u * f.y);
            }
        }
        if (lane == 0) y[r] = __float2bfloat16(s);
    };
#pragma unroll
    for (int p = 0; p < PF; ++p) {
        const int r = warp + p * nwarps;
        if (r < rows) {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < KW; ++i) s += dot2(pre[p][i], xr[i]);
            finish_row(r, s);
        }
    }
    for (int r = warp + PF * nwarps; r < rows; r += nwarps) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < KW; ++i) s += dot2(__ldg(W + (long long)r * kw + i * 32 + lane), xr[i]);
        finish_row(r, s);
    }
    if (MODE == 0) return;
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int c = threadIdx.x; c < 2 * kw; c += 256) {
        float v;
        if (MODE == 1) {
            v = 0.f;
            for (int r = c; r < rows; r += 2 * kw) v += __bfloat162float(__ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(y) + r)));
        } else {
            v = __ldcg(acc + c);
            acc[c] = 0.f;
        }
        out[c] = __float2bfloat16(v);
    }
    if (threadIdx.x == 0) *ticket = 0u;
}

struct Shape { const char* name; int d, qkv, att_rows, gate, layers, head, active_mod; };

static int st_prints = 0;
template <int KW, int PF>
struct Step {
    Shape s;
    uint32_t *wqkv, *wo, *wg, *wud, *cache, *whead;
    __nv_bfloat16 *h, *qkv, *att, *o, *logits, *att_y, *mlp_y;
    float* acc;
    unsigned* tickets;
    int blocks_small, blocks_head;
    void init() {
        const int kw = s.d / 2;
        auto alloc_w = [&](size_t words) {
            uint32_t* p;
            CK(cudaMalloc(&p, words * 4));
            std::vector<uint32_t> hbuf(words);
            uint32_t st = 12345;
            for (auto& v : hbuf) { st = st * 1664525u + 1013904223u; v = 0x3c003c00u ^ (st & 0x807f807fu); }
            CK(cudaMemcpy(p, hbuf.data(), words * 4, cudaMemcpyHostToDevice));
            return p;
        };
        wqkv = alloc_w((size_t)s.layers * s.qkv * kw);
        wo = alloc_w((size_t)s.layers * s.d * kw);
        wg = alloc_w((size_t)s.layers * s.gate * kw);
        wud = alloc_w((size_t)s.layers * s.gate * 2 * kw);
        cache = alloc_w((size_t)s.layers * s.att_rows * kw);
        whead = alloc_w((size_t)s.head * kw);
        auto alloc_b = [&](size_t n) { __nv_bfloat16* p; CK(cudaMalloc(&p, n * 2)); CK(cudaMemset(p, 0, n * 2)); return p; };
        h = alloc_b(s.d); qkv = alloc_b(s.qkv); att = alloc_b(s.d); o = alloc_b(s.d); logits = alloc_b(s.head);
        att_y = alloc_b(s.att_rows); mlp_y = alloc_b(s.gate);
        CK(cudaMalloc(&acc, s.d * 4)); CK(cudaMemset(acc, 0, s.d * 4));
        CK(cudaMalloc(&tickets, 4 * 2 * s.layers)); CK(cudaMemset(tickets, 0, 8 * s.layers));
    }
    template <int MODE>
    void launch(cudaStream_t st, bool pdl, int trigger, int blocks, const uint32_t* W, int rows, const __nv_bfloat16* x,
                __nv_bfloat16* y, __nv_bfloat16* out, unsigned* ticket) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(256);
        cfg.stream = st;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = pdl ? 1 : 0;
        CK(cudaLaunchKernelEx(&cfg, layer_kernel<KW, PF, MODE>, W, (const uint32_t*)wud, rows, s.active_mod, x, y, out, acc, ticket, trigger));
    }
    // One step; with `allocs`, each kernel's output goes to a buffer from cudaMallocAsync, freed after its reader.
    void run(cudaStream_t st, bool pdl, int trigger, bool allocs) {
        const int kw = s.d / 2;
        __nv_bfloat16* x = h;
        std::vector<void*> pending;
        auto buf = [&](__nv_bfloat16* fixed, size_t n) {
            if (!allocs) return fixed;
            void* p;
            CK(cudaMallocAsync(&p, n * 2, st));
            pending.push_back(p);
            return (__nv_bfloat16*)p;
        };
        auto release = [&]() {
            if (!allocs) return;
            while (pending.size() > 2) { CK(cudaFreeAsync(pending.front(), st)); pending.erase(pending.begin()); }
        };
        for (int l = 0; l < s.layers; ++l) {
            __nv_bfloat16* q = buf(qkv, s.qkv);
            launch<0>(st, pdl, trigger, blocks_small, wqkv + (size_t)l * s.qkv * kw, s.qkv, x, q, nullptr, nullptr);
            release();
            __nv_bfloat16* a = buf(att, s.d);
            launch<1>(st, pdl, trigger, blocks_small, cache + (size_t)l * s.att_rows * kw, s.att_rows, q, att_y, a, tickets + 2 * l);
            release();
            __nv_bfloat16* ob = buf(o, s.d);
            launch<0>(st, pdl, trigger, blocks_small, wo + (size_t)l * s.d * kw, s.d, a, ob, nullptr, nullptr);
            release();
            __nv_bfloat16* hn = buf(h, s.d);
            launch<2>(st, pdl, trigger, blocks_small, wg + (size_t)l * s.gate * kw, s.gate, ob, mlp_y, hn, tickets + 2 * l + 1);
            release();
            x = hn;
        }
        launch<0>(st, pdl, trigger, blocks_head, whead, s.head, x, logits, nullptr, nullptr);
        if (allocs) for (void* p : pending) CK(cudaFreeAsync(p, st));
    }
    float time(bool pdl, int trigger, bool allocs) {
        cudaStream_t st;
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        run(st, pdl, trigger, allocs);
        CK(cudaStreamEndCapture(st, &g));
        size_t ne = 0;
        CK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &ne));
        std::vector<cudaGraphNode_t> from(ne), to(ne);
        std::vector<cudaGraphEdgeData> ed(ne);
        CK(cudaGraphGetEdges(g, from.data(), to.data(), ed.data(), &ne));
        int prog = 0;
        for (auto& e : ed) prog += e.type == cudaGraphDependencyTypeProgrammatic;
        if (pdl && (st_prints++ < 40)) printf("    [graph: %zu edges, %d programmatic%s]\n", ne, prog, allocs ? ", alloc nodes" : "");
        cudaGraphExec_t ge;
        CK(cudaGraphInstantiate(&ge, g, 0));
        for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, st));
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
        const int n = 200;
        CK(cudaEventRecord(a, st));
        for (int i = 0; i < n; ++i) CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g)); CK(cudaStreamDestroy(st));
        return ms * 1000.f / n;
    }
};

template <int KW, int PF>
void bench(Shape s, int blocks_small) {
    Step<KW, PF> st{};
    st.s = s;
    st.blocks_small = blocks_small;
    st.blocks_head = 132 * 4;
    st.init();
    for (int round = 0; round < 2; ++round) {
        const float base = st.time(false, 0, false);
        const float pdl = st.time(true, 0, false);
        const float pdl_t = st.time(true, 1, false);
        printf("%-8s PF %d blocks %3d | step us: plain %7.1f  pdl %7.1f (%.2fx)  pdl+trigger %7.1f (%.2fx)\n", s.name, PF,
               blocks_small, base, pdl, base / pdl, pdl_t, base / pdl_t);
        fflush(stdout);
        const float base_a = st.time(false, 0, true);
        const float pdl_a = st.time(true, 1, true);
        printf("%-8s PF %d blocks %3d | with alloc nodes: plain %7.1f  pdl+trigger %7.1f (%.2fx)\n", s.name, PF,
               blocks_small, base_a, pdl_a, base_a / pdl_a);
        fflush(stdout);
    }
}

int main() {
    // SmolLM2-135M: d 576 (KW 9), q/k/v 960, cache 512 positions x 3 kv heads x 64 x 2 (k, v) = 341 rows of 576.
    Shape smol{"smollm2", 576, 960, 341, 1536, 30, 49152, 33};
    Shape big{"1.5b", 2048, 6144, 1024, 5632, 28, 49152, 200};
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int full9 = 0, full32 = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&full9, layer_kernel<9, 1, 2>, 256, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&full32, layer_kernel<32, 1, 2>, 256, 0));
    printf("SMs %d, blocks an SM at full occupancy: KW 9 %d, KW 32 %d\n", sms, full9, full32);
    bench<9, 1>(smol, sms);
    bench<9, 2>(smol, sms / 2);
    bench<9, 1>(smol, sms * full9);  // a full wave, as the real step kernels launch
    bench<32, 1>(big, sms * 2);
    bench<32, 1>(big, sms * full32);
    return 0;
}

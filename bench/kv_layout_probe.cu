// Does the decode attention read the KV cache faster when each KV head's positions are
// contiguous? The project's own attend_range (kernels/src/causal_attention.cu) over two
// cache layouts of `batch` sequences:
//   position-major (the slot cache now): [seq][pos][K heads | V heads][hd]
//   head-major:                          [seq][K | V][kv head][pos][hd]
// nvcc -O3 -arch=sm_90 -I kernels/src -o kvprobe bench/kv_layout_probe.cu
#include "causal_attention.cu"
#include <cstdio>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at line %d\n", cudaGetErrorString(e_), __LINE__); exit(1);} } while (0)

template <int HD>
__global__ void __launch_bounds__(DECODE_THREADS) probe_attend(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                                                               __nv_bfloat16* __restrict__ out, int heads, int kv_heads, int T,
                                                               Strides kst, long long v_off) {
    extern __shared__ float scores[];
    __shared__ float qs[HD];
    const int h = blockIdx.x, kvh = h / (heads / kv_heads);
    for (int e = threadIdx.x; e < HD; e += DECODE_THREADS)
        qs[e] = __bfloat162float(q[(static_cast<long long>(blockIdx.y) * heads + h) * HD + e]) * 0.125f;
    __syncthreads();
    attend_one_from<HD>(qs, kv, kv + v_off, out, heads, kvh, T, kst, kst, scores, nullptr, nullptr);
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("card %s\n", prop.name);
    struct Case { int heads, kv_heads, T; };
    const Case cases[] = {{32, 32, 512}, {9, 3, 512}, {32, 8, 512}, {32, 32, 2048}, {32, 8, 2048}};
    const int HD = 64;
    for (const Case& c : cases) {
        for (int batch : {4, 16, 64}) {
            const long long w = (long long)c.kv_heads * HD;
            const long long per_seq = (long long)c.T * 2 * w;
            const int copies = std::max(1, (int)(400e6 / (per_seq * batch * 2)));  // rotate past L2
            std::vector<__nv_bfloat16*> kv(copies);
            for (auto& p : kv) { CK(cudaMalloc(&p, per_seq * batch * 2)); CK(cudaMemset(p, 0x3c, per_seq * batch * 2)); }
            __nv_bfloat16 *q, *out;
            CK(cudaMalloc(&q, (size_t)batch * c.heads * HD * 2)); CK(cudaMemset(q, 0x3c, (size_t)batch * c.heads * HD * 2));
            CK(cudaMalloc(&out, (size_t)batch * c.heads * HD * 2));
            const size_t smem = (c.T + 1) * sizeof(float);
            CK(cudaFuncSetAttribute(probe_attend<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
            printf("heads %d/%d, %d positions, %d sequences: KV %.1f MB a step\n", c.heads, c.kv_heads, c.T, batch,
                   per_seq * batch * 2 / 1e6);
            for (int rep = 0; rep < 2; ++rep) {
                for (int layout = 0; layout < 2; ++layout) {
                    Strides kst;
                    long long v_off;
                    if (layout == 0) { kst = Strides{per_seq, HD, 2 * w}; v_off = w; }
                    else { kst = Strides{per_seq, (long long)c.T * HD, HD}; v_off = w * c.T; }
                    cudaEvent_t a, b;
                    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
                    const int iters = 200;
                    for (int i = 0; i < 20; ++i)
                        probe_attend<64><<<dim3(c.heads, batch), DECODE_THREADS, smem>>>(q, kv[i % copies], out, c.heads, c.kv_heads, c.T, kst, v_off);
                    CK(cudaEventRecord(a));
                    for (int i = 0; i < iters; ++i)
                        probe_attend<64><<<dim3(c.heads, batch), DECODE_THREADS, smem>>>(q, kv[i % copies], out, c.heads, c.kv_heads, c.T, kst, v_off);
                    CK(cudaEventRecord(b));
                    CK(cudaEventSynchronize(b));
                    CK(cudaGetLastError());
                    float ms; CK(cudaEventElapsedTime(&ms, a, b));
                    const double us = ms * 1000.0 / iters;
                    printf("  %s: %.2f us, %.2f TB/s\n", layout == 0 ? "position-major" : "head-major    ", us,
                           per_seq * batch * 2 / (us * 1e-6) / 1e12);
                }
            }
            for (auto p : kv) cudaFree(p);
            cudaFree(q); cudaFree(out);
        }
    }
    return 0;
}

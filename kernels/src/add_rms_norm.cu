// add_rms_norm: the residual add and the RMS norm after it, in one pass over the rows.
//
// A Llama block adds each sublayer's output to the residual stream and normalises the
// sum for the next sublayer: as two candle ops that is three reads and two writes of
// [M, d] and two launches (candle's norm also reads bf16 one element at a time). Here one
// block per row reads x and y once (16-byte loads), writes the sum s = x + y rounded to
// bf16 (what candle's add would store) and the normalised row
// s · rsqrt(mean(s²) + eps) · alpha, in candle's order of operations.
//
// With y null the kernel is the norm alone (out [M, d]): training takes the sum as an
// autograd node of its own, so that the norm's input gets its gradient without the
// halves of a joined [2M, d] result (each half a narrow, whose backward pads its
// gradient with zeros to the whole).
#include "rms_norm_row.cuh"

// 16-byte vectors a thread keeps in registers between the two passes (d up to 8,192).
#define NORM_MAX_VECS 4

extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rms_norm_bf16(
    const __nv_bfloat16* __restrict__ x,      // [M, d]
    const __nv_bfloat16* __restrict__ y,      // [M, d], or null: the norm of x alone
    const __nv_bfloat16* __restrict__ alpha,  // [d]
    __nv_bfloat16* __restrict__ out,          // [2M, d]: the sums, then the normalised rows ([M, d] without y)
    int M, int d, float eps) {
    const long long row = blockIdx.x;
    if (row >= M) return;
    const int vecs = d / VEC;
    const long long base = row * d;
    uint4 a[NORM_MAX_VECS], b[NORM_MAX_VECS];
    float s[NORM_MAX_VECS][VEC];
    norm_row_load<NORM_MAX_VECS>(x + base, vecs, a);
    if (y) {
        norm_row_load<NORM_MAX_VECS>(y + base, vecs, b);
    } else {
#pragma unroll
        for (int i = 0; i < NORM_MAX_VECS; ++i) b[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    const float ss = norm_row_add<NORM_MAX_VECS>(a, b, s);
    if (y) norm_row_store<NORM_MAX_VECS>(out + base, vecs, s);
    const float scale = norm_row_scale(ss, d, eps);
    // alpha is read after the reduction, so the sums' registers are free for it.
    norm_row_load<NORM_MAX_VECS>(alpha, vecs, a);
    norm_row_store_scaled<NORM_MAX_VECS>(out + (y ? static_cast<long long>(M) * d : 0LL) + base, vecs, scale, s, a);
}

// The backward of the norm. With s its input (the sum), r = rsqrt(mean(s²) + eps), and the
// gradient g_n of the normalised row:
//   ds     = r · alpha ⊙ g_n − s · r³ · mean(alpha ⊙ g_n ⊙ s)
//   dalpha = Σ_rows g_n ⊙ s · r.
// (The sum's own gradient meets ds in candle's autograd, which gives x and y both.)
// A block walks `rows_per_block` rows, keeping its share of dalpha in registers, and
// adds it to the f32 accumulator once: one atomic per column per block.
template <int MAXV>
__device__ __forceinline__ void add_rms_norm_bwd(
    const __nv_bfloat16* __restrict__ sum,    // [M, d]
    const __nv_bfloat16* __restrict__ grad,   // [M, d]: g_n
    const __nv_bfloat16* __restrict__ alpha,  // [d]
    __nv_bfloat16* __restrict__ out,          // [M * d + d]: ds rows (dalpha by the next kernel)
    float* __restrict__ dalpha,               // [d], zeroed
    int M, int d, float eps, int rows_per_block) {
    const int vecs = d / VEC;
    float a[MAXV][VEC], acc[MAXV][VEC];
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
        const int v = threadIdx.x + i * NORM_THREADS;
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[i][k] = 0.f;
        if (v < vecs) load8(alpha + v * VEC, a[i]);
    }
    __shared__ float2 partial[NORM_THREADS / 32];
    const long long first = static_cast<long long>(blockIdx.x) * rows_per_block;
    for (long long row = first; row < first + rows_per_block && row < M; ++row) {
        const long long base = row * d;
        float s[MAXV][VEC], gn[MAXV][VEC];
        float ss = 0.f, c = 0.f;
#pragma unroll
        for (int i = 0; i < MAXV; ++i) {
            const int v = threadIdx.x + i * NORM_THREADS;
            if (v < vecs) {
                load8(sum + base + v * VEC, s[i]);
                load8(grad + base + v * VEC, gn[i]);
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    ss = fmaf(s[i][k], s[i][k], ss);
                    c = fmaf(a[i][k] * gn[i][k], s[i][k], c);
                }
            }
        }
        ss = warp_sum(ss);
        c = warp_sum(c);
        if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = make_float2(ss, c);
        __syncthreads();
        float total_ss = 0.f, total_c = 0.f;
#pragma unroll
        for (int w = 0; w < NORM_THREADS / 32; ++w) {
            total_ss += partial[w].x;
            total_c += partial[w].y;
        }
        __syncthreads();  // partial is reused by the next row
        const float r = rsqrtf(total_ss / d + eps);
        const float k3 = r * r * r * total_c / d;
#pragma unroll
        for (int i = 0; i < MAXV; ++i) {
            const int v = threadIdx.x + i * NORM_THREADS;
            if (v < vecs) {
                float o[VEC];
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    o[k] = r * a[i][k] * gn[i][k] - s[i][k] * k3;
                    acc[i][k] = fmaf(gn[i][k], s[i][k] * r, acc[i][k]);
                }
                store8(out + base + v * VEC, o);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
        const int v = threadIdx.x + i * NORM_THREADS;
        if (v < vecs) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) red_add(dalpha + v * VEC + k, acc[i][k]);
        }
    }
}

// Instantiations by the 16-byte vectors a thread holds per row (d up to 2,048, 4,096
// and 8,192): the backward keeps four row-sized arrays in registers, so the narrow rows
// of the usual models must not pay for the widest.
#define ADD_RMS_NORM_BWD(V)                                                                   \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rms_norm_bwd_v##V##_bf16(  \
        const __nv_bfloat16* __restrict__ sum, const __nv_bfloat16* __restrict__ grad,        \
        const __nv_bfloat16* __restrict__ alpha, __nv_bfloat16* __restrict__ out,             \
        float* __restrict__ dalpha, int M, int d, float eps, int rows_per_block) {            \
        add_rms_norm_bwd<V>(sum, grad, alpha, out, dalpha, M, d, eps, rows_per_block);        \
    }
ADD_RMS_NORM_BWD(1)
ADD_RMS_NORM_BWD(2)
ADD_RMS_NORM_BWD(4)

// dalpha (f32, summed over rows) into the tail of the backward's output, as bf16.
extern "C" __global__ void add_rms_norm_alpha_bf16(const float* __restrict__ dalpha,
                                                    __nv_bfloat16* __restrict__ out, int d) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < d) out[j] = __float2bfloat16(dalpha[j]);
}

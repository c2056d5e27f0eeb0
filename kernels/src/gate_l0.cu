// gate_l0: each token's smooth count of positive gates, Σ_j φ(z_ij) with
// z_ij = relu(g_ij)·c / (‖x_i‖·‖Wg_j‖) and φ(z) = z / (z + ε), and its backward.
//
// As candle ops the term made about twenty f32 passes over [tokens, d_ff] per layer,
// forward and backward. Here the forward reads the bf16 gates once (a block per row);
// the backward reads them once for the gates' gradient and once more for the norms'
// gradients: row sums (a block per row), and column sums in two deterministic steps
// (partial sums over chunks of rows, then a fixed-order sum of the partials).
#include "common.cuh"

#define GL0_THREADS 256
// Rows per block of the column partial sums.
#define GL0_CHUNK 64

// The block's sum of v, in thread 0.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[GL0_THREADS / 32];
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
    if (threadIdx.x == 0) {
        for (int w = 0; w < GL0_THREADS / 32; ++w) s += partial[w];
    }
    return s;
}

// φ'(z)·z, the weight of a gate in the norms' gradients (0 where the gate is not positive).
__device__ __forceinline__ float slope_times_z(float g, float xn, float wn, float scale, float eps) {
    if (g <= 0.f) return 0.f;
    const float z = g * scale / (xn * wn);
    const float s = z + eps;
    return eps * z / (s * s);
}

extern "C" __global__ void __launch_bounds__(GL0_THREADS) gate_l0_fwd_bf16(
    const __nv_bfloat16* __restrict__ gate,  // [N, F]
    const float* __restrict__ x_norm,        // [N]
    const float* __restrict__ w_norm,        // [F]
    float* __restrict__ out,                 // [N]
    int N, int F, float scale, float eps) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const __nv_bfloat16* g = gate + row * F;
    const float xn = x_norm[row];
    float acc = 0.f;
    for (int j = threadIdx.x; j < F; j += GL0_THREADS) {
        const float v = __bfloat162float(g[j]);
        if (v > 0.f) {
            const float z = v * scale / (xn * w_norm[j]);
            acc += z / (z + eps);
        }
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[row] = acc;
}

extern "C" __global__ void __launch_bounds__(GL0_THREADS) gate_l0_grad_gate_bf16(
    const __nv_bfloat16* __restrict__ gate,  // [N, F]
    const float* __restrict__ norms,         // [N + F]: x_norm, then w_norm
    const float* __restrict__ go,            // [N]
    __nv_bfloat16* __restrict__ out,         // [N, F]
    int N, int F, float scale, float eps) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const __nv_bfloat16* g = gate + row * F;
    __nv_bfloat16* o = out + row * F;
    const float xn = norms[row], gr = go[row];
    const float* w_norm = norms + N;
    for (int j = threadIdx.x; j < F; j += GL0_THREADS) {
        const float v = __bfloat162float(g[j]);
        float d = 0.f;
        if (v > 0.f) {
            const float k = scale / (xn * w_norm[j]);
            const float s = v * k + eps;
            d = gr * eps / (s * s) * k;
        }
        o[j] = __float2bfloat16(d);
    }
}

// out[i] = −go_i·Σ_j φ'(z_ij)·z_ij / ‖x_i‖ for the N rows.
extern "C" __global__ void __launch_bounds__(GL0_THREADS) gate_l0_grad_rows_bf16(
    const __nv_bfloat16* __restrict__ gate, const float* __restrict__ norms,
    const float* __restrict__ go, float* __restrict__ out, int N, int F, float scale, float eps) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const __nv_bfloat16* g = gate + row * F;
    const float xn = norms[row];
    const float* w_norm = norms + N;
    float acc = 0.f;
    for (int j = threadIdx.x; j < F; j += GL0_THREADS) {
        acc += slope_times_z(__bfloat162float(g[j]), xn, w_norm[j], scale, eps);
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[row] = -go[row] * acc / xn;
}

// partial[c, j] = Σ_{i in chunk c} go_i·φ'(z_ij)·z_ij; grid (columns / 256, chunks).
extern "C" __global__ void __launch_bounds__(GL0_THREADS) gate_l0_grad_column_partials_bf16(
    const __nv_bfloat16* __restrict__ gate, const float* __restrict__ norms,
    const float* __restrict__ go, float* __restrict__ partial, int N, int F, float scale,
    float eps) {
    const int j = blockIdx.x * GL0_THREADS + threadIdx.x;
    if (j >= F) return;
    const float wn = norms[N + j];
    const int start = blockIdx.y * GL0_CHUNK;
    const int end = min(N, start + GL0_CHUNK);
    float acc = 0.f;
    for (int i = start; i < end; ++i) {
        const float v = __bfloat162float(gate[static_cast<long long>(i) * F + j]);
        acc += go[i] * slope_times_z(v, norms[i], wn, scale, eps);
    }
    partial[static_cast<long long>(blockIdx.y) * F + j] = acc;
}

// out[j] = −Σ_c partial[c, j] / ‖Wg_j‖, the chunks summed in order.
extern "C" __global__ void __launch_bounds__(GL0_THREADS) gate_l0_grad_columns(
    const float* __restrict__ partial, const float* __restrict__ norms, float* __restrict__ out,
    int N, int F, int chunks) {
    const int j = blockIdx.x * GL0_THREADS + threadIdx.x;
    if (j >= F) return;
    float acc = 0.f;
    for (int c = 0; c < chunks; ++c) acc += partial[static_cast<long long>(c) * F + j];
    out[j] = -acc / norms[N + j];
}

// adamw: the AdamW update of one f32 parameter in two in-place passes.
//
// As candle ops an update is some seventeen elementwise passes over the parameter
// (moments, bias corrections, square root, division, decay, subtraction, the copy into
// the variable); on a 1.5 B-parameter model that is most of the optimizer's 130 ms.
// Here:
//   adamw_moment_f32: m ← β·m + (1 − β)·(s·g), or with `square` the same on (s·g)²
//                     (s the clipping scale), in place on m or v;
//   adamw_update_f32: p ← p·(1 − lr·wd) − lr·(m / c1) / (√(v / c2) + eps), in place.
#include <cuda_runtime.h>

extern "C" __global__ void adamw_moment_f32(float* __restrict__ moment,
                                            const float* __restrict__ grad, long long n,
                                            float beta, float scale, int square) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float g = grad[i] * scale;
        if (square) g *= g;
        moment[i] = fmaf(beta, moment[i], (1.f - beta) * g);
    }
}

extern "C" __global__ void adamw_update_f32(float* __restrict__ param, const float* __restrict__ m,
                                            const float* __restrict__ v, long long n, float lr,
                                            float decay, float inv_c1, float inv_c2, float eps) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float update = (m[i] * inv_c1) / (sqrtf(v[i] * inv_c2) + eps);
        param[i] = param[i] * decay - lr * update;
    }
}

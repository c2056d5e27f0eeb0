// Fills buffers: with a bit pattern (the tests poison every output buffer with a NaN
// pattern before the kernels run, so an element a kernel failed to write shows), or with
// zeros (scratch).
#include <stdint.h>

// Fills n 16-bit words with `bits` (tests poison outputs with a NaN pattern).
extern "C" __global__ void twell_fill_u16(uint16_t* __restrict__ p, long long n, uint16_t bits) {
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        p[i] = bits;
}

// Fills n 32-bit words with zero: the ops' zeroed scratch. A kernel and not a memset: a
// captured decode step launches a memset node at a host cost of about 11 µs each, where
// kernel nodes cost the host next to nothing.
extern "C" __global__ void twell_zero_u32(uint32_t* __restrict__ p, long long n) {
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x)
        p[i] = 0u;
}

// Tensor-core building blocks of the kernels that run mma.sync (sm_80 and later): the
// m16n8k16 bf16 product, ldmatrix loads of its fragments from shared memory, and cp.async
// copies from global to shared memory.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

// c += a · b for one m16n8k16 tile: a is the 16 x 16 row-major fragment, b the 16 x 8
// column-major one, c the 16 x 8 f32 accumulator, all in PTX's per-lane layout.
__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 x 8 bf16 matrices from shared memory, transposed: lanes 8i .. 8i + 7 give the
// row addresses of matrix i, and r[i] is this lane's pair of matrix i, column-wise.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const __nv_bfloat16* row) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Four 8 x 8 bf16 matrices from shared memory, as stored: r[i] is this lane's pair of
// matrix i, row-wise.
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const __nv_bfloat16* row) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16 bytes global -> shared without passing through registers; `valid` false writes zeros.
__device__ __forceinline__ void copy16_async(__nv_bfloat16* dst, const __nv_bfloat16* src, bool valid) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

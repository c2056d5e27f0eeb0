//! CPU kernels: the reference implementation every GPU kernel is checked against, and
//! a fast path of its own (rayon threads, AVX2 inner loops, work proportional to the
//! nonzeros).

pub mod gate;
pub mod huge_pages;
pub mod int8;
pub mod low_rank;
pub mod quant;
pub mod screen;
pub mod simd;
pub mod t2d;
pub mod warm;

// The CPU-Adam kernel compiled for avx512. See simd.h for why each ISA is its own translation unit.
#include <cstdint>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include "kernel_args.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#define ZO_ISA_AVX512
namespace zo {
namespace avx512 {
#include "simd.h"
#include "cpu_adam_kernel.h"
ZO_DEFINE_ISA_ENTRY_POINTS
}  // namespace avx512
}  // namespace zo
#pragma GCC pop_options
#endif

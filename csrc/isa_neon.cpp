// The CPU-Adam kernel compiled for AArch64 Advanced SIMD (NEON). See simd.h for why each ISA is its own translation
// unit. No `#pragma GCC target`: AdvSIMD is part of the AArch64 baseline the compiler targets by default.
#include <cstdint>
#if defined(__aarch64__)
#include <arm_neon.h>
#include "kernel_args.h"

#define ZO_ISA_NEON
namespace zo {
namespace neon {
#include "simd.h"
#include "cpu_adam_kernel.h"
ZO_DEFINE_ISA_ENTRY_POINTS
}  // namespace neon
}  // namespace zo
#endif

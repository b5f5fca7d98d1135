// The CPU-Adam kernel compiled for scalar. See simd.h for why each ISA is its own translation unit.
#include <cstdint>
#include "kernel_args.h"

#define ZO_ISA_SCALAR
namespace zo {
namespace scalar {
#include "simd.h"
#include "cpu_adam_kernel.h"
ZO_DEFINE_ISA_ENTRY_POINTS
}  // namespace scalar
}  // namespace zo

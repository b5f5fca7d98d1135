// Plain-data description of one kernel call, shared by the dispatcher (which includes ATen) and the per-ISA
// translation units (which include nothing but intrinsics). Keeping this struct free of inline code is what makes
// compiling the same kernel body under several `#pragma GCC target` regions safe: no symbol other than the ISA's
// own entry points is emitted from those units, so the linker can never pick an AVX-512 copy of a shared helper.
#pragma once
#include <cstdint>

namespace zo {

// kQ8 is a state dtype only: 8-bit block-wise moments (int8 exp_avg, uint8 exp_avg_sq and max_exp_avg_sq), each
// with one fp32 scale per kQBlock elements. See cpu_adam_kernel.h for the mapping.
enum class DType : int32_t { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3, kQ8 = 4 };

// Elements per scale block of kQ8 state: the buckets' 64-element slot alignment, so that any 64-aligned segment of a
// flat buffer owns whole blocks (its last possibly partial) and can be updated alone; a multiple of every vector
// width (16, 8, 4, 1 floats).
constexpr int64_t kQBlock = 64;

// Every state buffer comes as a source (`*_in`, read) and a destination (written). In place, the dispatcher passes
// the same pointer for both; out of place (a ping-pong: read set A, write set B, A left as it was), a
// destination shares no byte with any source, so a vector loop may read ahead of what it writes. Either way it is
// one memory pass: each element's sources are read once, before its destinations are written.
struct AdamArgs {
  const float* param_in;   // fp32 master, read
  float* param;            // fp32 master, written
  const void* grad;        // gradient, grad_dtype
  const void* exp_avg_in;  // first moment, state_dtype
  void* exp_avg;
  const void* exp_avg_sq_in;  // second moment, state_dtype
  void* exp_avg_sq;
  const void* max_exp_avg_sq_in;  // amsgrad running max, state_dtype; null (both) unless amsgrad
  void* max_exp_avg_sq;
  void* param_out;         // optional copy of the updated param, out_dtype; null when out_dtype == kNone
  // kQ8 state only (else null): one fp32 scale per kQBlock elements of the buffer above it, indexed by element / 64
  // from the same origin, so a range [begin, end) must start on a block boundary.
  const float* exp_avg_scale_in;
  float* exp_avg_scale;
  const float* exp_avg_sq_scale_in;
  float* exp_avg_sq_scale;
  const float* max_exp_avg_sq_scale_in;
  float* max_exp_avg_sq_scale;
  DType grad_dtype;
  DType state_dtype;
  DType out_dtype;
  // Scalars, each rounded once from the double-precision values computed by the caller.
  float grad_scale;        // multiplies the gradient before anything else (loss-scale inverse x clip coefficient)
  float lerp_weight;       // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float step_size;         // lr / (1 - beta1^step)
  float inv_bc2_sqrt;      // 1 / sqrt(1 - beta2^step)
  float eps;
  float decay_factor;      // 1 - lr * weight_decay (decoupled); 1 when no decoupled decay
  float l2_weight_decay;   // weight_decay for the L2 (Adam) form; 0 otherwise
  bool amsgrad;
  bool maximize;
};

struct SqNormResult {
  double sum_sq;           // sum of squares of the (float-converted) gradient
  bool nonfinite;          // any element inf or nan
};

// Each ISA unit defines these in namespace zo::<isa>.
#define ZO_DECLARE_ISA(ns)                                                          \
  namespace ns {                                                                    \
  void adam_range(const AdamArgs& a, int64_t begin, int64_t end);                   \
  SqNormResult sq_norm_range(const void* grad, DType dtype, int64_t begin, int64_t end); \
  }

ZO_DECLARE_ISA(scalar)
#if defined(__x86_64__) || defined(_M_X64)
ZO_DECLARE_ISA(avx2)
ZO_DECLARE_ISA(avx512)
#endif
#if defined(__aarch64__)
ZO_DECLARE_ISA(neon)
#endif

}  // namespace zo

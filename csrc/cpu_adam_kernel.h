// The CPU-Adam kernel body, written once against the ISA layer in simd.h and compiled once per ISA (see the
// isa_*.cpp units). One pass per element: read the gradient (fp32/bf16/fp16), the fp32 master and the moments
// (fp32/bf16), write master and moments, and optionally the updated parameter rounded to fp32/bf16/fp16.
//
// The arithmetic follows torch.optim.AdamW's single-tensor path operation for operation (lerp for the first
// moment, mul-then-addcmul for the second, sqrt / bias-correction + eps, addcdiv), so results agree with it to a
// few ulps; the scalars come in already rounded from double.
//
// Like simd.h, this is a body to include inside an ISA unit's namespace, after simd.h; every function is static.
#pragma once

template <zo::DType D>
static inline VF load_as_float(const void* base, int64_t i) {
  if constexpr (D == zo::DType::kF32) return load_f32(static_cast<const float*>(base) + i);
  else if constexpr (D == zo::DType::kBF16) return load_bf16(static_cast<const uint16_t*>(base) + i);
  else return load_f16(static_cast<const uint16_t*>(base) + i);
}

template <zo::DType D>
static inline void store_from_float(void* base, int64_t i, VF x) {
  if constexpr (D == zo::DType::kF32) store_f32(static_cast<float*>(base) + i, x);
  else if constexpr (D == zo::DType::kBF16) store_bf16(static_cast<uint16_t*>(base) + i, x);
  else if constexpr (D == zo::DType::kF16) store_f16(static_cast<uint16_t*>(base) + i, x);
}

template <zo::DType D>
static inline void stream_from_float(void* base, int64_t i, VF x) {
  if constexpr (D == zo::DType::kF32) stream_f32(static_cast<float*>(base) + i, x);
  else if constexpr (D == zo::DType::kBF16) stream_bf16(static_cast<uint16_t*>(base) + i, x);
  else if constexpr (D == zo::DType::kF16) stream_f16(static_cast<uint16_t*>(base) + i, x);
}

static inline int elem_size(zo::DType d) { return d == zo::DType::kF32 ? 4 : d == zo::DType::kNone ? 0 : 2; }

struct Pointers {
  float* p;
  const void* g;
  void* m;
  void* v;
  void* vmax;
  void* out;
};

template <zo::DType G, zo::DType S, zo::DType O, bool kStreamOut>
static inline void adam_vector(const zo::AdamArgs& a, const Pointers& q, int64_t i) {
  VF g = mul(load_as_float<G>(q.g, i), set1(a.grad_scale));
  if (a.maximize) g = mul(g, set1(-1.0f));
  VF p = load_f32(q.p + i);
  if (a.l2_weight_decay != 0.0f) g = fma(p, set1(a.l2_weight_decay), g);  // Adam: grad + wd * param
  p = mul(p, set1(a.decay_factor));                                         // AdamW: param * (1 - lr * wd)

  VF m = load_as_float<S>(q.m, i);
  const float w = a.lerp_weight;  // torch's lerp: two forms, chosen by the weight, for accuracy near 1
  m = (w < 0.5f) ? fma(set1(w), sub(g, m), m) : sub(g, mul(sub(g, m), set1(1.0f - w)));
  VF v = fma(mul(g, set1(a.one_minus_beta2)), g, mul(load_as_float<S>(q.v, i), set1(a.beta2)));
  VF v_used = v;
  if (a.amsgrad) {
    v_used = vmax(load_as_float<S>(q.vmax, i), v);
    store_from_float<S>(q.vmax, i, v_used);
  }
  VF denom = fma(vsqrt(v_used), set1(a.inv_bc2_sqrt), set1(a.eps));
  p = fma(set1(-a.step_size), div(m, denom), p);

  store_f32(q.p + i, p);
  store_from_float<S>(q.m, i, m);
  store_from_float<S>(q.v, i, v);
  if constexpr (kStreamOut) stream_from_float<O>(q.out, i, p);
  else store_from_float<O>(q.out, i, p);
}

template <zo::DType G, zo::DType S, zo::DType O>
static void adam_range_typed(const zo::AdamArgs& a, int64_t begin, int64_t end) {
  const Pointers q{a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.max_exp_avg_sq, a.param_out};
  int64_t i = begin;
  // The low-precision output is written once and next read by a copy to the GPU, not by this core: streaming
  // stores skip the read-for-ownership of its lines (measured: about 5% of the offload path's time at 100M
  // elements). They need alignment, so they are used when the range starts on a 64-byte boundary, which the
  // dispatcher's block split gives for any buffer torch allocated.
  const bool stream = O != zo::DType::kNone && (reinterpret_cast<uintptr_t>(q.out) + i * elem_size(O)) % 64 == 0;
  if (stream) {
    for (; i + kW <= end; i += kW) adam_vector<G, S, O, true>(a, q, i);
    stream_fence();  // order the streaming stores before whatever reads the output after this call
  } else {
    for (; i + kW <= end; i += kW) adam_vector<G, S, O, false>(a, q, i);
  }
  if (i == end) return;
  // Tail shorter than one vector: run the very same vector code on a zero-padded copy, then copy back only
  // the live elements, so tails get bit-identical arithmetic to the body.
  const int64_t n = end - i;
  alignas(64) float pb[kW] = {};
  alignas(64) uint8_t gb[kW * 4] = {}, mb[kW * 4] = {}, vb[kW * 4] = {}, xb[kW * 4] = {}, ob[kW * 4] = {};
  const int gs = elem_size(G), ss = elem_size(S), os = elem_size(O);
  __builtin_memcpy(pb, q.p + i, n * 4);
  __builtin_memcpy(gb, static_cast<const uint8_t*>(q.g) + i * gs, n * gs);
  __builtin_memcpy(mb, static_cast<uint8_t*>(q.m) + i * ss, n * ss);
  __builtin_memcpy(vb, static_cast<uint8_t*>(q.v) + i * ss, n * ss);
  if (a.amsgrad) __builtin_memcpy(xb, static_cast<uint8_t*>(q.vmax) + i * ss, n * ss);
  adam_vector<G, S, O, false>(a, Pointers{pb, gb, mb, vb, xb, ob}, 0);
  __builtin_memcpy(q.p + i, pb, n * 4);
  __builtin_memcpy(static_cast<uint8_t*>(q.m) + i * ss, mb, n * ss);
  __builtin_memcpy(static_cast<uint8_t*>(q.v) + i * ss, vb, n * ss);
  if (a.amsgrad) __builtin_memcpy(static_cast<uint8_t*>(q.vmax) + i * ss, xb, n * ss);
  if (os) __builtin_memcpy(static_cast<uint8_t*>(q.out) + i * os, ob, n * os);
}

template <zo::DType G, zo::DType S>
static void adam_range_out(const zo::AdamArgs& a, int64_t b, int64_t e) {
  switch (a.out_dtype) {
    case zo::DType::kNone: return adam_range_typed<G, S, zo::DType::kNone>(a, b, e);
    case zo::DType::kF32: return adam_range_typed<G, S, zo::DType::kF32>(a, b, e);
    case zo::DType::kBF16: return adam_range_typed<G, S, zo::DType::kBF16>(a, b, e);
    case zo::DType::kF16: return adam_range_typed<G, S, zo::DType::kF16>(a, b, e);
  }
}

template <zo::DType G>
static void adam_range_state(const zo::AdamArgs& a, int64_t b, int64_t e) {
  if (a.state_dtype == zo::DType::kBF16) adam_range_out<G, zo::DType::kBF16>(a, b, e);
  else adam_range_out<G, zo::DType::kF32>(a, b, e);
}

template <zo::DType G>
static zo::SqNormResult sq_norm_typed(const void* grad, int64_t begin, int64_t end) {
  // Squares are summed in float vectors over blocks of 64 vectors (at most 32 terms per accumulator lane) and the
  // blocks in double: float-fast, and accurate for buffers of hundreds of millions of elements. x - x is 0 for
  // finite x and NaN for inf/nan, so one extra subtract-and-add per vector tells non-finite values apart from a
  // sum that merely overflowed (which, as in torch's fp32 norm, gives inf).
  constexpr int64_t kBlock = 64 * kW;
  double total = 0.0;
  VF bad = set1(0.0f);
  int64_t i = begin;
  while (i + kW <= end) {
    const int64_t stop = (end - i > kBlock) ? i + kBlock : end;
    VF acc0 = set1(0.0f), acc1 = set1(0.0f);
    for (; i + 2 * kW <= stop; i += 2 * kW) {
      VF x0 = load_as_float<G>(grad, i), x1 = load_as_float<G>(grad, i + kW);
      acc0 = fma(x0, x0, acc0);
      acc1 = fma(x1, x1, acc1);
      bad = add(bad, add(sub(x0, x0), sub(x1, x1)));
    }
    for (; i + kW <= stop; i += kW) {
      VF x = load_as_float<G>(grad, i);
      acc0 = fma(x, x, acc0);
      bad = add(bad, sub(x, x));
    }
    total += static_cast<double>(hsum(add(acc0, acc1)));
  }
  if (i < end) {  // tail: the same vector code on a zero-padded copy (zeros add nothing and are finite)
    alignas(64) uint8_t buf[kW * 4] = {};
    __builtin_memcpy(buf, static_cast<const uint8_t*>(grad) + i * elem_size(G), (end - i) * elem_size(G));
    VF x = load_as_float<G>(buf, 0);
    total += static_cast<double>(hsum(mul(x, x)));
    bad = add(bad, sub(x, x));
  }
  return zo::SqNormResult{total, any_nan(bad)};
}

// Entry points of one ISA unit; the unit wraps this in its namespace.
#define ZO_DEFINE_ISA_ENTRY_POINTS                                                                      \
  void adam_range(const AdamArgs& a, int64_t begin, int64_t end) {                                     \
    switch (a.grad_dtype) {                                                                            \
      case DType::kF32: return adam_range_state<DType::kF32>(a, begin, end);                           \
      case DType::kBF16: return adam_range_state<DType::kBF16>(a, begin, end);                         \
      case DType::kF16: return adam_range_state<DType::kF16>(a, begin, end);                           \
      case DType::kNone: return;                                                                       \
    }                                                                                                  \
  }                                                                                                    \
  SqNormResult sq_norm_range(const void* grad, DType dtype, int64_t begin, int64_t end) {              \
    switch (dtype) {                                                                                   \
      case DType::kBF16: return sq_norm_typed<DType::kBF16>(grad, begin, end);                         \
      case DType::kF16: return sq_norm_typed<DType::kF16>(grad, begin, end);                           \
      default: return sq_norm_typed<DType::kF32>(grad, begin, end);                                    \
    }                                                                                                  \
  }

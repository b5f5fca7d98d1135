// The CPU-Adam kernel body, written once against the ISA layer in simd.h and compiled once per ISA (see the
// isa_*.cpp units). One pass per element: read the gradient (fp32/bf16/fp16), the fp32 master and the moments
// (fp32, bf16, or 8-bit block-wise codes with a scale per block), write master and moments, and optionally the
// updated parameter rounded to fp32/bf16/fp16.
//
// Master, moments and scales are read from one set of pointers and written to another (AdamArgs' *_in and the
// rest): the same buffers in place, disjoint ones out of place. The code is the same either way, so the two give
// bit-identical results; every element's sources are read before its destinations are written, and the vector
// loop reads nothing at an index it has already written, so only exact aliasing (or none) is safe.
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

template <zo::DType D, bool kStream>
static inline void put(void* base, int64_t i, VF x) {
  if constexpr (kStream) stream_from_float<D>(base, i, x);
  else store_from_float<D>(base, i, x);
}

static inline int elem_size(zo::DType d) {
  return d == zo::DType::kF32 ? 4 : d == zo::DType::kNone ? 0 : d == zo::DType::kQ8 ? 1 : 2;
}

// Whether element i of a buffer of `size`-byte elements sits on a 64-byte boundary (null: no buffer, true).
static inline bool aligned64(const void* base, int64_t i, int size) {
  return base == nullptr || (reinterpret_cast<uintptr_t>(base) + i * size) % 64 == 0;
}

// Sources (*_in) and destinations of one range: the same pointers in place, disjoint buffers out of place.
struct Pointers {
  const float* p_in;
  float* p;
  const void* g;
  const void* m_in;
  void* m;
  const void* v_in;
  void* v;
  const void* vmax_in;
  void* vmax;
  void* out;
};

// The update's scalars, broadcast once per range into a local: read through the AdamArgs reference instead, each
// would be reloaded and re-broadcast for every vector, since the compiler must assume any store to the buffers may
// have changed it (measured with callgrind, AVX2: the fp32 path ran 5.75 instructions per element with the reloads,
// 2.13 without; its time, bound by the divider, barely moved, but the 8-bit path's did).
struct Coeffs {
  VF grad_scale;  // with maximize's sign folded in (a sign flip is exact, so the product is the same)
  VF l2, decay, w, one_minus_w, one_minus_beta2, beta2, inv_bc2_sqrt, eps, neg_step;
  bool l2_on, lerp_low, amsgrad;
};

static inline Coeffs coeffs_of(const zo::AdamArgs& a) {
  const float w = a.lerp_weight;
  return Coeffs{set1(a.maximize ? -a.grad_scale : a.grad_scale), set1(a.l2_weight_decay), set1(a.decay_factor),
                set1(w), set1(1.0f - w), set1(a.one_minus_beta2), set1(a.beta2), set1(a.inv_bc2_sqrt),
                set1(a.eps), set1(-a.step_size), a.l2_weight_decay != 0.0f, w < 0.5f, a.amsgrad};
}

// The update of one vector from its (float) inputs, shared by every state dtype.
struct Updated {
  VF p, m, v, v_used, root_used;  // root_used = sqrt(v_used), the denominator's square root
};

template <zo::DType G>
static inline Updated adam_math(const Coeffs& c, const void* grad, int64_t i, VF p, VF m, VF v_old, VF vmax_old) {
  VF g = mul(load_as_float<G>(grad, i), c.grad_scale);
  if (c.l2_on) g = fma(p, c.l2, g);  // Adam: grad + wd * param
  p = mul(p, c.decay);               // AdamW: param * (1 - lr * wd)

  // torch's lerp: two forms, chosen by the weight, for accuracy near 1
  m = c.lerp_low ? fma(c.w, sub(g, m), m) : sub(g, mul(sub(g, m), c.one_minus_w));
  const VF v = fma(mul(g, c.one_minus_beta2), g, mul(v_old, c.beta2));
  const VF v_used = c.amsgrad ? vmax(vmax_old, v) : v;
  const VF root = vsqrt(v_used);
  const VF denom = fma(root, c.inv_bc2_sqrt, c.eps);
  p = fma(c.neg_step, div(m, denom), p);
  return Updated{p, m, v, v_used, root};
}

template <zo::DType G, zo::DType S, zo::DType O, bool kStreamOut, bool kStreamState>
static inline void adam_vector(const Coeffs& c, const Pointers& q, int64_t i) {
  // The gradient is read before the output is written, at the same index: param_out may be the gradient's memory.
  const Updated u = adam_math<G>(c, q.g, i, load_f32(q.p_in + i), load_as_float<S>(q.m_in, i),
                                 load_as_float<S>(q.v_in, i), c.amsgrad ? load_as_float<S>(q.vmax_in, i) : set1(0.0f));
  if (c.amsgrad) put<S, kStreamState>(q.vmax, i, u.v_used);
  put<zo::DType::kF32, kStreamState>(q.p, i, u.p);
  put<S, kStreamState>(q.m, i, u.m);
  put<S, kStreamState>(q.v, i, u.v);
  put<O, kStreamOut>(q.out, i, u.p);
}

template <zo::DType G, zo::DType S, zo::DType O, bool kStreamOut, bool kStreamState>
static inline int64_t adam_vectors(const Coeffs& c, const Pointers& q, int64_t i, int64_t end) {
  for (; i + kW <= end; i += kW) adam_vector<G, S, O, kStreamOut, kStreamState>(c, q, i);
  return i;
}

// Out of place, the destinations' lines are in no cache (what was read is the sources): a plain store first reads
// each line it writes (read-for-ownership), 12 more bytes per element for fp32 state, 40% over the 28 of the pass
// (measured: out of place ran 1.56x the in-place time with plain stores). Streaming stores write whole lines without
// reading them, so the out-of-place pass moves what the in-place one does. They need every destination of the
// range at a 64-byte boundary, as a bucket's buffers and slots are; else plain stores. In place, the lines were just
// read and are in cache, where a plain store is the cheap one.
static inline bool stream_state_of(const zo::AdamArgs& a, int64_t i, int state_size) {
  return a.param != a.param_in && aligned64(a.param, i, 4) && aligned64(a.exp_avg, i, state_size) &&
         aligned64(a.exp_avg_sq, i, state_size) && aligned64(a.max_exp_avg_sq, i, state_size);
}

template <zo::DType G, zo::DType S, zo::DType O>
static void adam_range_typed(const zo::AdamArgs& a, int64_t begin, int64_t end) {
  const Pointers q{a.param_in, a.param, a.grad, a.exp_avg_in, a.exp_avg, a.exp_avg_sq_in, a.exp_avg_sq,
                   a.max_exp_avg_sq_in, a.max_exp_avg_sq, a.param_out};
  const Coeffs c = coeffs_of(a);
  int64_t i = begin;
  // The low-precision output is written once and next read by a copy to the GPU, not by this core: streaming
  // stores skip the read-for-ownership of its lines (measured: about 5% of the offload path's time at 100M
  // elements). They need alignment, so they are used when the range starts on a 64-byte boundary, which the
  // dispatcher's block split gives for any buffer torch allocated. Not when the output is the gradient's memory:
  // its lines are in cache already (just read), and a streaming store would evict each one between its reads.
  const bool stream = O != zo::DType::kNone && q.out != q.g && aligned64(q.out, i, elem_size(O));
  const bool stream_state = stream_state_of(a, i, elem_size(S));
  if (stream_state) {
    i = stream ? adam_vectors<G, S, O, true, true>(c, q, i, end) : adam_vectors<G, S, O, false, true>(c, q, i, end);
  } else {
    i = stream ? adam_vectors<G, S, O, true, false>(c, q, i, end) : adam_vectors<G, S, O, false, false>(c, q, i, end);
  }
  if (stream || stream_state) stream_fence();  // order the streaming stores before whatever reads after this call
  if (i == end) return;
  // Tail shorter than one vector: run the very same vector code on a zero-padded copy, then copy back only
  // the live elements, so tails get bit-identical arithmetic to the body. (The copies are taken from the sources
  // and go back to the destinations.)
  const int64_t n = end - i;
  alignas(64) float pb[kW] = {};
  alignas(64) uint8_t gb[kW * 4] = {}, mb[kW * 4] = {}, vb[kW * 4] = {}, xb[kW * 4] = {}, ob[kW * 4] = {};
  const int gs = elem_size(G), ss = elem_size(S), os = elem_size(O);
  __builtin_memcpy(pb, q.p_in + i, n * 4);
  __builtin_memcpy(gb, static_cast<const uint8_t*>(q.g) + i * gs, n * gs);
  __builtin_memcpy(mb, static_cast<const uint8_t*>(q.m_in) + i * ss, n * ss);
  __builtin_memcpy(vb, static_cast<const uint8_t*>(q.v_in) + i * ss, n * ss);
  if (a.amsgrad) __builtin_memcpy(xb, static_cast<const uint8_t*>(q.vmax_in) + i * ss, n * ss);
  adam_vector<G, S, O, false, false>(c, Pointers{pb, pb, gb, mb, mb, vb, vb, xb, xb, ob}, 0);
  __builtin_memcpy(q.p + i, pb, n * 4);
  __builtin_memcpy(static_cast<uint8_t*>(q.m) + i * ss, mb, n * ss);
  __builtin_memcpy(static_cast<uint8_t*>(q.v) + i * ss, vb, n * ss);
  if (a.amsgrad) __builtin_memcpy(static_cast<uint8_t*>(q.vmax) + i * ss, xb, n * ss);
  if (os) __builtin_memcpy(static_cast<uint8_t*>(q.out) + i * os, ob, n * os);
}

// ---- 8-bit block-wise state (DType::kQ8) ----
//
// Each block of kQBlock elements keeps one fp32 scale s per moment: the largest magnitude in the block after the
// update. Codes compand by a square root, so that the small values of a block keep resolution (a linear code would
// round everything under s/254 to zero):
//   exp_avg     int8 c in [-127, 127]:  m = s * c|c| / 127^2       c = round(127 sqrt(|m| / s)), with m's sign
//   exp_avg_sq  uint8 c in [0, 255]:    v = s * (c / 255)^4         c = round(255 sqrt(sqrt(v) / sqrt(s)))
// The second moment is a square, so the fourth root puts sqrt(v), the quantity the update divides by, on the same
// square-root code as m, with twice the levels: the smallest non-zero sqrt(v) is 1/255^2 of the block's largest,
// finer than m's 1/127^2, so an element whose denominator rounds to zero has a numerator that did too (up to the
// moments' different histories). max_exp_avg_sq (amsgrad) is coded like exp_avg_sq with its own scales.
//
// One memory pass per block: dequantise, update (the parameter from the unquantised new moments, as the GPU 8-bit
// optimizers do), keep the new moments in a block-sized buffer in L1, then take the block's scale and requantise
// from that buffer. Rounding is to nearest, ties to even. Blocks are independent: a range that starts on a block
// boundary touches no other block, and a partial last block takes its scale from its live elements only.
//
// Non-finite moments stay per element, as AdamW keeps them: an element whose new m, v (or running max) is inf or
// NaN is *poisoned*: exp_avg code kPoison (-128, which quantisation never writes: it saturates at +-127), 0 in the
// other codes, and it reads back as NaN moments. The block's scales come from its finite elements, and the sign bit
// of its exp_avg scale says that it holds a poisoned element, so the common block pays one branch. Such a block is
// updated like any other (its scales' magnitudes), after its poisoned elements' parameters are set to NaN, the value
// AdamW's NaN moments give them; its second-moment scales are the largest sqrt(v) squared (v itself is not kept),
// within an ulp of the largest v.
constexpr float kMCode = 127.0f, kVCode = 255.0f;
constexpr float kFltMin = 1.17549435e-38f, kFltMax = 3.40282347e38f;
constexpr float kTinyCode = 0x1p-100f;  // see quantise_m
constexpr int8_t kPoison = -128;

// Sources (*_in) and destinations, as in Pointers.
struct QPointers {
  const float* p_in;
  float* p;
  const void* g;
  const int8_t* m_in;
  int8_t* m;
  const uint8_t* v_in;
  uint8_t* v;
  const uint8_t* vmax_in;
  uint8_t* vmax;
  void* out;
  const float* m_scale_in;
  float* m_scale;
  const float* v_scale_in;
  float* v_scale;
  const float* vmax_scale_in;
  float* vmax_scale;
};

// c * (1/127) is exactly 1 at c = 127 (likewise for 255), so a block's largest code dequantises to its scale
// exactly, and a dequantised block requantises to the same codes and scale (state_dict round trips are lossless).
// (Folding the constants into a per-block sqrt(s) / 127 saves a multiply per moment but measured no faster, and on
// the scalar path its rounding, amplified where the update cancels most of the old moment, went past the tests'
// 16-ulp bound on a scale.)
static inline VF dequant_m(VF c, float s) {
  const VF f = mul(c, set1(1.0f / kMCode));
  return mul(mul(f, vabs(f)), set1(s));
}
static inline VF dequant_v(VF c, float s) {
  const VF f = mul(c, set1(1.0f / kVCode)), f2 = mul(f, f);
  return mul(mul(f2, f2), set1(s));
}

// A block's new scale from its largest (finite) magnitude: 0, with all codes 0, below FLT_MIN (where 1/s would
// overflow).
static inline float block_scale(float largest) { return largest >= kFltMin ? largest : 0.0f; }

// Vectors per block; codes are narrowed and stored four vectors at a time.
constexpr int kBlockVecs = static_cast<int>(zo::kQBlock) / kW;
static_assert(kBlockVecs % 4 == 0, "a block must be a whole number of 4-vector code groups");

// The position of a value on the code line is u = sqrt(|x| * k), k = code^2 / s: code * sqrt(|x| / s) with one
// multiply fewer per vector, and the root taken by sqrt_nodiv (see simd.h), so that the divider serves only the
// update's own square root and division, as in the fp32 path. The FMA adds kTinyCode to |x| * k, keeping the
// root's argument off 0 for free (it changes a u above 2^-38 by less than half an ulp, and a smaller u rounds to
// code 0 either way). u exceeds the top code by a few ulps at most, which rounds to it; the narrowing saturates
// anyway.
template <bool kStream>
__attribute__((always_inline)) static inline float quantise_m(const VF* m, float largest, int8_t* codes) {
  const float s = block_scale(largest);
  if (!(s > 0.0f)) {
    __builtin_memset(codes, 0, zo::kQBlock);
    return s;
  }
  // 127^2 / s overflows below s = 4.7e-35 (2^-114): for blocks under 2^-60, magnitudes are raised by 2^64 first.
  const bool tiny = s < 0x1p-60f;
  const VF k = set1(kMCode * kMCode / (tiny ? s * 0x1p64f : s));
  for (int j = 0; j < kBlockVecs; j += 4) {
    VF u[4];
    for (int t = 0; t < 4; ++t) {
      VF x = vabs(m[j + t]);
      if (tiny) x = mul(x, set1(0x1p64f));
      u[t] = sqrt_nodiv(fma(x, k, set1(kTinyCode)));
    }
    store_s8x4<kStream>(codes + j * kW, u[0], u[1], u[2], u[3], m[j], m[j + 1], m[j + 2], m[j + 3]);
  }
  return s;
}

// roots holds sqrt(v) (the update computed it already); largest is the block's largest v. u = sqrt(sqrt(v) * k),
// k = 255^2 / sqrt(s), finite for every s >= FLT_MIN.
template <bool kStream>
__attribute__((always_inline)) static inline float quantise_v(const VF* roots, float largest, uint8_t* codes) {
  const float s = block_scale(largest);
  if (!(s > 0.0f)) {
    __builtin_memset(codes, 0, zo::kQBlock);
    return s;
  }
  const VF k = set1(kVCode * kVCode / __builtin_sqrtf(s));
  for (int j = 0; j < kBlockVecs; j += 4)
    store_u8x4<kStream>(codes + j * kW, sqrt_nodiv(fma(roots[j], k, set1(kTinyCode))),
               sqrt_nodiv(fma(roots[j + 1], k, set1(kTinyCode))), sqrt_nodiv(fma(roots[j + 2], k, set1(kTinyCode))),
               sqrt_nodiv(fma(roots[j + 3], k, set1(kTinyCode))));
  return s;
}

// A block between its two passes: the updated moments (with sqrt(v), which the update computed already, instead of
// v) and their largest magnitudes, waiting in L1 for the block's scale.
struct QBlock {
  VF m[kBlockVecs], root[kBlockVecs], root_max[kBlockVecs];
  VF m_top, v_top, x_top;
};

// Pass one of the block starting at element i (a multiple of kQBlock from the pointers' origin): dequantise, update
// the parameter (from the unquantised new moments, as the GPU 8-bit optimizers do) and keep the new moments in blk.
// q comes by value and c.amsgrad is the constant kAms, so pointers and modes stay in registers across the stores.
// p_in: where the block's masters are read, q.p_in but for a poisoned block (see poison_params_q8).
template <zo::DType G, zo::DType O, bool kStreamOut, bool kStreamState, bool kAms>
__attribute__((always_inline)) static inline void update_block_q8(const Coeffs& c, const QPointers q,
                                                                  const float* p_in, int64_t i, QBlock& blk) {
  const int64_t b = i / zo::kQBlock;
  const float sm = __builtin_fabsf(q.m_scale_in[b]), sv = q.v_scale_in[b], sx = kAms ? q.vmax_scale_in[b] : 0.0f;
  // Largest magnitudes by bit pattern: a NaN sorts above inf above every finite value, so one integer max per moment
  // both finds the scale and keeps any non-finite value visible.
  VF m_top = set1(0.0f), v_top = set1(0.0f), x_top = set1(0.0f);
#pragma GCC unroll 8
  for (int j = 0; j < kBlockVecs; ++j) {
    const int64_t k = i + j * kW;
    // The gradient is read before the output is written, at the same index: param_out may be the gradient's memory.
    const Updated u = adam_math<G>(c, q.g, k, load_f32(p_in + k), dequant_m(load_s8(q.m_in + k), sm),
                                   dequant_v(load_u8(q.v_in + k), sv),
                                   kAms ? dequant_v(load_u8(q.vmax_in + k), sx) : set1(0.0f));
    put<zo::DType::kF32, kStreamState>(q.p, k, u.p);
    put<O, kStreamOut>(q.out, k, u.p);
    blk.m[j] = u.m;
    m_top = vmax_magnitude(m_top, u.m);
    v_top = vmax_nonneg(v_top, u.v);
    if constexpr (kAms) {
      blk.root[j] = vsqrt(u.v);
      blk.root_max[j] = u.root_used;
      x_top = vmax_nonneg(x_top, u.v_used);
    } else {
      blk.root[j] = u.root_used;  // sqrt(v) itself when there is no running max
    }
  }
  blk.m_top = m_top;
  blk.v_top = v_top;
  blk.x_top = x_top;
}

// Pass two for a block with a poisoned element (old ones in the mask, new ones found here; see kPoison): scales and
// codes of its finite elements, then the poisoned ones marked. Rare, so plain scalar code on a copy of the block.
template <bool kAms>
__attribute__((noinline)) static void requantise_poisoned_block_q8(const QPointers q, int64_t i, QBlock blk,
                                                                   uint64_t poisoned) {
  float* m = reinterpret_cast<float*>(blk.m);
  float* root = reinterpret_cast<float*>(blk.root);
  float* root_max = reinterpret_cast<float*>(blk.root_max);
  float top_m = 0.0f, top_v = 0.0f, top_x = 0.0f;
  for (int e = 0; e < zo::kQBlock; ++e) {
    const bool finite = __builtin_fabsf(m[e]) <= kFltMax && root[e] <= kFltMax && (!kAms || root_max[e] <= kFltMax);
    if (!finite || (poisoned >> e & 1)) {
      poisoned |= uint64_t{1} << e;
      m[e] = root[e] = root_max[e] = 0.0f;
      continue;
    }
    top_m = __builtin_fmaxf(top_m, __builtin_fabsf(m[e]));
    top_v = __builtin_fmaxf(top_v, __builtin_fminf(root[e] * root[e], kFltMax));
    if (kAms) top_x = __builtin_fmaxf(top_x, __builtin_fminf(root_max[e] * root_max[e], kFltMax));
  }
  const int64_t b = i / zo::kQBlock;
  // Plain stores: the poisoned codes below go to the same lines.
  q.m_scale[b] = -quantise_m<false>(blk.m, top_m, q.m + i);  // the sign bit flags the block (-0.0 for a zero scale)
  q.v_scale[b] = quantise_v<false>(blk.root, top_v, q.v + i);
  if constexpr (kAms) q.vmax_scale[b] = quantise_v<false>(blk.root_max, top_x, q.vmax + i);
  for (int e = 0; e < zo::kQBlock; ++e) {
    if (poisoned >> e & 1) {
      q.m[i + e] = kPoison;
      q.v[i + e] = 0;
      if constexpr (kAms) q.vmax[i + e] = 0;
    }
  }
}

// Before a flagged block's pass one: its poisoned elements' parameters become NaN, what AdamW's NaN moments make
// of them (the update then carries the NaN into param_out as well); returns them as a mask. The block's masters
// go to the destination, NaNs included, and the update reads them from there: out of place, the source stays as
// it was. (A rare path: a copy of 64 floats is nothing to it.)
static inline uint64_t poison_params_q8(const QPointers& q, int64_t i) {
  uint64_t poisoned = 0;
  for (int e = 0; e < zo::kQBlock; ++e) {
    float x = q.p_in[i + e];
    if (q.m_in[i + e] == kPoison) {
      poisoned |= uint64_t{1} << e;
      x = __builtin_nanf("");
    }
    q.p[i + e] = x;
  }
  return poisoned;
}

// Pass two: the block's scales from its largest magnitudes, and its codes.
template <bool kStreamState, bool kAms>
__attribute__((always_inline)) static inline void requantise_block_q8(const QPointers q, int64_t i,
                                                                      const QBlock& blk, uint64_t poisoned) {
  const int64_t b = i / zo::kQBlock;
  const float largest_m = hmax_magnitude(blk.m_top), largest_v = hmax_magnitude(blk.v_top);
  const bool nonfinite = !(largest_m <= kFltMax && largest_v <= kFltMax);  // true for inf and NaN
  if (__builtin_expect(nonfinite || poisoned != 0, 0)) return requantise_poisoned_block_q8<kAms>(q, i, blk, poisoned);
  q.m_scale[b] = quantise_m<kStreamState>(blk.m, largest_m, q.m + i);
  q.v_scale[b] = quantise_v<kStreamState>(blk.root, largest_v, q.v + i);
  if constexpr (kAms)
    q.vmax_scale[b] = quantise_v<kStreamState>(blk.root_max, hmax_magnitude(blk.x_top), q.vmax + i);
}

// The inputs of the block starting at element i, into the cache ahead of use. The hardware prefetcher alone leaves
// this compute-heavy loop waiting on memory: prefetching 8 blocks (512 elements) ahead measured 20-25% faster on
// 2e7 elements (AVX2 and AVX-512 alike; 2 and 4 blocks ahead gain less). The output is stored, not read.
// always_inline: out of line, GCC finds a function of prefetches free of side effects and deletes the call.
template <zo::DType G, bool kAms>
__attribute__((always_inline)) static inline void prefetch_block_q8(const QPointers& q, int64_t i) {
  const char* p = reinterpret_cast<const char*>(q.p_in + i);
  for (int o = 0; o < zo::kQBlock * 4; o += 64) __builtin_prefetch(p + o);
  const char* g = static_cast<const char*>(q.g) + i * elem_size(G);
  for (int o = 0; o < zo::kQBlock * elem_size(G); o += 64) __builtin_prefetch(g + o);
  __builtin_prefetch(q.m_in + i);
  __builtin_prefetch(q.v_in + i);
  if constexpr (kAms) __builtin_prefetch(q.vmax_in + i);
}

// Whole blocks from i to end; returns where they end. (Software-pipelining the two passes, pass two of a block
// after pass one of the next, measured no faster: the out-of-order core overlaps them already.)
template <zo::DType G, zo::DType O, bool kStreamOut, bool kStreamState, bool kAms>
static inline int64_t adam_blocks_q8(const Coeffs& c, const QPointers q, int64_t i, int64_t end) {
  constexpr int64_t kAhead = 8 * zo::kQBlock;
  QBlock blk;
  for (; i + zo::kQBlock <= end; i += zo::kQBlock) {
    if (i + kAhead + zo::kQBlock <= end) prefetch_block_q8<G, kAms>(q, i + kAhead);
    const bool flagged = __builtin_expect(__builtin_signbit(q.m_scale_in[i / zo::kQBlock]), 0);
    const uint64_t poisoned = flagged ? poison_params_q8(q, i) : 0;
    update_block_q8<G, O, kStreamOut, kStreamState, kAms>(c, q, flagged ? q.p : q.p_in, i, blk);
    requantise_block_q8<kStreamState, kAms>(q, i, blk, poisoned);
  }
  return i;
}

template <zo::DType G, zo::DType O, bool kAms>
static void adam_range_q8(const zo::AdamArgs& a, int64_t begin, int64_t end) {
  // begin is a block boundary (the dispatcher splits at multiples of kQBlock and checks segment offsets).
  const QPointers q{a.param_in, a.param, a.grad,
                    static_cast<const int8_t*>(a.exp_avg_in), static_cast<int8_t*>(a.exp_avg),
                    static_cast<const uint8_t*>(a.exp_avg_sq_in), static_cast<uint8_t*>(a.exp_avg_sq),
                    static_cast<const uint8_t*>(a.max_exp_avg_sq_in), static_cast<uint8_t*>(a.max_exp_avg_sq),
                    a.param_out, a.exp_avg_scale_in, a.exp_avg_scale, a.exp_avg_sq_scale_in, a.exp_avg_sq_scale,
                    a.max_exp_avg_sq_scale_in, a.max_exp_avg_sq_scale};
  Coeffs c = coeffs_of(a);
  c.amsgrad = kAms;
  int64_t i = begin;
  // As in adam_range_typed; a block's codes are one 64-byte line of each code buffer.
  const bool stream = O != zo::DType::kNone && q.out != q.g && aligned64(q.out, i, elem_size(O));
  const bool stream_state = stream_state_of(a, i, 1);
  if (stream_state) {
    i = stream ? adam_blocks_q8<G, O, true, true, kAms>(c, q, i, end)
               : adam_blocks_q8<G, O, false, true, kAms>(c, q, i, end);
  } else {
    i = stream ? adam_blocks_q8<G, O, true, false, kAms>(c, q, i, end)
               : adam_blocks_q8<G, O, false, false, kAms>(c, q, i, end);
  }
  if (stream || stream_state) stream_fence();
  if (i == end) return;
  // Partial last block: the same block code on zero-padded copies, copied back for the live elements only. The
  // padding cannot move the scale: its gradient, moments and param are 0, so its new moments are 0 too.
  const int64_t n = end - i, b = i / zo::kQBlock;
  constexpr int64_t B = zo::kQBlock;
  alignas(64) float pb[B] = {};
  alignas(64) uint8_t gb[B * 4] = {}, ob[B * 4] = {}, vb[B] = {}, xb[B] = {};
  alignas(64) int8_t mb[B] = {};
  float sm = q.m_scale_in[b], sv = q.v_scale_in[b], sx = kAms ? q.vmax_scale_in[b] : 0.0f;
  const int gs = elem_size(G), os = elem_size(O);
  __builtin_memcpy(pb, q.p_in + i, n * 4);
  __builtin_memcpy(gb, static_cast<const uint8_t*>(q.g) + i * gs, n * gs);
  __builtin_memcpy(mb, q.m_in + i, n);
  __builtin_memcpy(vb, q.v_in + i, n);
  if (kAms) __builtin_memcpy(xb, q.vmax_in + i, n);
  const QPointers padded{pb, pb, gb, mb, mb, vb, vb, xb, xb, ob, &sm, &sm, &sv, &sv, &sx, &sx};
  adam_blocks_q8<G, O, false, false, kAms>(c, padded, 0, B);
  __builtin_memcpy(q.p + i, pb, n * 4);
  __builtin_memcpy(q.m + i, mb, n);
  __builtin_memcpy(q.v + i, vb, n);
  q.m_scale[b] = sm;
  q.v_scale[b] = sv;
  if (kAms) {
    __builtin_memcpy(q.vmax + i, xb, n);
    q.vmax_scale[b] = sx;
  }
  if (os) __builtin_memcpy(static_cast<uint8_t*>(q.out) + i * os, ob, n * os);
}

template <zo::DType G, bool kAms>
static void adam_range_q8_out(const zo::AdamArgs& a, int64_t b, int64_t e) {
  switch (a.out_dtype) {
    case zo::DType::kF32: return adam_range_q8<G, zo::DType::kF32, kAms>(a, b, e);
    case zo::DType::kBF16: return adam_range_q8<G, zo::DType::kBF16, kAms>(a, b, e);
    case zo::DType::kF16: return adam_range_q8<G, zo::DType::kF16, kAms>(a, b, e);
    default: return adam_range_q8<G, zo::DType::kNone, kAms>(a, b, e);
  }
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
  if (a.state_dtype == zo::DType::kQ8 && a.amsgrad) adam_range_q8_out<G, true>(a, b, e);
  else if (a.state_dtype == zo::DType::kQ8) adam_range_q8_out<G, false>(a, b, e);
  else if (a.state_dtype == zo::DType::kBF16) adam_range_out<G, zo::DType::kBF16>(a, b, e);
  else adam_range_out<G, zo::DType::kF32>(a, b, e);
}

// Whole blocks of sq_norm_typed (64 vectors each) read kSqStreams at a time, from as many stretches of the
// range side by side. One sequential read stream leaves a core waiting on memory (it has few misses in flight);
// four keep more in flight (measured on a 2-vCPU AMD EPYC VM, 16.8M fp32 elements: 9.6 to 14.2 GB/s alone, 8.5 to
// 11 GB/s with a second process doing the same). Each block's sum is formed exactly as in the one-stream loop and
// the blocks' sums are added in their order, so the result is bit for bit the same.
constexpr int kSqStreams = 4;
constexpr int64_t kSqRun = 256;  // blocks per stretch and round: the blocks' sums wait on the stack

template <zo::DType G>
static int64_t sq_norm_streams(const void* grad, int64_t begin, int64_t end, double& total, VF& bad) {
  constexpr int64_t kBlock = 64 * kW;
  int64_t i = begin;
  for (;;) {
    const int64_t blocks = (end - i) / kBlock / kSqStreams;
    const int64_t per = blocks < kSqRun ? blocks : kSqRun;
    if (per == 0) return i;
    float sums[kSqStreams * kSqRun];
    for (int64_t j = 0; j < per; ++j) {
      VF acc0[kSqStreams], acc1[kSqStreams];
      for (int s = 0; s < kSqStreams; ++s) acc0[s] = acc1[s] = set1(0.0f);
      for (int64_t k = 0; k < kBlock; k += 2 * kW) {
        for (int s = 0; s < kSqStreams; ++s) {
          const int64_t at = i + (s * per + j) * kBlock + k;
          VF x0 = load_as_float<G>(grad, at), x1 = load_as_float<G>(grad, at + kW);
          acc0[s] = fma(x0, x0, acc0[s]);
          acc1[s] = fma(x1, x1, acc1[s]);
          bad = add(bad, add(sub(x0, x0), sub(x1, x1)));
        }
      }
      for (int s = 0; s < kSqStreams; ++s) sums[s * per + j] = hsum(add(acc0[s], acc1[s]));
    }
    for (int64_t b = 0; b < kSqStreams * per; ++b) total += static_cast<double>(sums[b]);
    i += kSqStreams * per * kBlock;
  }
}

template <zo::DType G>
static zo::SqNormResult sq_norm_typed(const void* grad, int64_t begin, int64_t end) {
  // Squares are summed in float vectors over blocks of 64 vectors (at most 32 terms per accumulator lane) and the
  // blocks in double: float-fast, and accurate for buffers of hundreds of millions of elements. x - x is 0 for
  // finite x and NaN for inf/nan, so one extra subtract-and-add per vector tells non-finite values apart from a
  // sum that merely overflowed (which, as in torch's fp32 norm, gives inf). Most blocks go through
  // sq_norm_streams; what it leaves (fewer than four whole blocks, a partial block, a tail) through the loop here.
  constexpr int64_t kBlock = 64 * kW;
  double total = 0.0;
  VF bad = set1(0.0f);
  int64_t i = sq_norm_streams<G>(grad, begin, end, total, bad);
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

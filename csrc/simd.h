// The ISA layer: a float vector type `VF` of width `kW` and the handful of operations the kernels need, for one
// instruction set chosen by the including translation unit (ZO_ISA_AVX512, ZO_ISA_AVX2, ZO_ISA_NEON or
// ZO_ISA_SCALAR). The including unit includes <cstdint> (and <immintrin.h> on x86, <arm_neon.h> on AArch64) at
// global scope, then opens the matching `#pragma GCC target` region (x86 only) and namespace and includes this file
// inside them: every function here is static and compiled for that one ISA, so no symbol can be shared, and
// mis-chosen by the linker, between ISAs.
//
// Conversions round to nearest-even. A NaN stays a NaN on the way down: bf16 NaNs become the canonical 0x7FC0
// (what c10::BFloat16 produces), so results compare bit-for-bit with `tensor.to(torch.bfloat16)`.
//
// 8-bit codes: load_s8/load_u8 widen kW codes to floats; store_s8x4/store_u8x4 round 4 vectors of non-negative
// floats to the nearest integer (ties to even, the default MXCSR mode) and narrow them with saturation, one shuffle
// chain for all four (store_*<true>: with a streaming store, which needs 4 * kW-byte alignment); store_s8x4 gives
// each code the sign of its value. The callers pass values at most a few ulps
// above the top code, so saturation never changes a code.
//
// For the 8-bit state's block maxima: vmax_magnitude keeps the largest |x| by bit pattern, compared as unsigned
// integers (NaN > inf > finite), so a NaN is never dropped the way vmaxps drops it; vmax_nonneg does the same
// without the absolute value, for x that is +0 or more or NaN (a NaN of either sign sorts above every such value);
// hmax_magnitude reduces either accumulator the same way. sqrt_nodiv is a square root off the divider unit (an
// rsqrt estimate and one Newton step, a few ulps from the true root; exact on the scalar path): the divider is what
// the fp32 kernel's throughput hangs on, and the 8-bit path already uses it as often as the fp32 path does.
#pragma once

#if defined(ZO_ISA_AVX512)

constexpr int kW = 16;
using VF = __m512;
static inline VF set1(float x) { return _mm512_set1_ps(x); }
static inline VF add(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF sub(VF a, VF b) { return _mm512_sub_ps(a, b); }
static inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF div(VF a, VF b) { return _mm512_div_ps(a, b); }
static inline VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
static inline VF vsqrt(VF a) { return _mm512_sqrt_ps(a); }
static inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
static inline float hsum(VF a) { return _mm512_reduce_add_ps(a); }
static inline bool any_nan(VF a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }

static inline VF load_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline void store_f32(float* p, VF x) { _mm512_storeu_ps(p, x); }
static inline VF load_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline __m256i bf16_bits(VF x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
static inline void store_bf16(uint16_t* p, VF x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x)); }
static inline VF load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m256i f16_bits(VF x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void store_f16(uint16_t* p, VF x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f16_bits(x)); }
// Non-temporal stores (aligned pointers only) for a write-only output: no read-for-ownership, no cache pollution.
static inline void stream_f32(float* p, VF x) { _mm512_stream_ps(p, x); }
static inline void stream_bf16(uint16_t* p, VF x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x)); }
static inline void stream_f16(uint16_t* p, VF x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), f16_bits(x)); }
static inline void stream_fence() { _mm_sfence(); }

static inline VF vabs(VF a) { return _mm512_abs_ps(a); }
static inline VF with_sign_of(VF mag, VF sign) {  // mag must be >= 0
  // One ternary-logic op: mag | (sign & 0x80000000), imm8 0xF8 is the truth table of a | (b & c).
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(mag), _mm512_castps_si512(sign),
                                                       _mm512_set1_epi32(int(0x80000000u)), 0xF8));
}
static inline VF load_s8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline VF load_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// The two saturating packs interleave the four vectors' 128-bit lanes; one dword permute puts them back in order.
static inline __m512i codes_in_order(__m512i packed) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), packed);
}
static inline __m512i signed_i32(VF u, VF sign) { return _mm512_cvtps_epi32(with_sign_of(u, sign)); }
template <bool kStream>
static inline void store_codes_x4(void* p, __m512i packed) {
  if constexpr (kStream) _mm512_stream_si512(reinterpret_cast<__m512i*>(p), codes_in_order(packed));
  else _mm512_storeu_si512(p, codes_in_order(packed));
}
template <bool kStream = false>
static inline void store_s8x4(int8_t* p, VF u0, VF u1, VF u2, VF u3, VF s0, VF s1, VF s2, VF s3) {
  const __m512i a = _mm512_packs_epi32(signed_i32(u0, s0), signed_i32(u1, s1));
  const __m512i b = _mm512_packs_epi32(signed_i32(u2, s2), signed_i32(u3, s3));
  store_codes_x4<kStream>(p, _mm512_packs_epi16(a, b));
}
template <bool kStream = false>
static inline void store_u8x4(uint8_t* p, VF u0, VF u1, VF u2, VF u3) {
  const __m512i a = _mm512_packs_epi32(_mm512_cvtps_epi32(u0), _mm512_cvtps_epi32(u1));
  const __m512i b = _mm512_packs_epi32(_mm512_cvtps_epi32(u2), _mm512_cvtps_epi32(u3));
  store_codes_x4<kStream>(p, _mm512_packus_epi16(a, b));
}
static inline VF vmax_magnitude(VF acc, VF x) {
  return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(acc), _mm512_castps_si512(vabs(x))));
}
static inline VF vmax_nonneg(VF acc, VF x) {
  return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(acc), _mm512_castps_si512(x)));
}
static inline float hmax_magnitude(VF a) {
  const uint32_t m = _mm512_reduce_max_epu32(_mm512_castps_si512(a));
  float f;
  __builtin_memcpy(&f, &m, 4);
  return f;
}
static inline VF sqrt_nodiv(VF x) {  // x >= 2^-100, normal: rsqrt(0) is inf, and 0 * inf NaN
  const VF r = _mm512_rsqrt14_ps(x), s = _mm512_mul_ps(x, r);  // r to 14 bits, s = x r ~ sqrt(x)
  // One Newton step on the residual, which the FMA computes exactly: s + (x - s^2) r / 2. Measured over every float
  // in [1, 4): within 0.6 ulp of the true root.
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(s, s, x), _mm512_mul_ps(r, _mm512_set1_ps(0.5f)), s);
}

#elif defined(ZO_ISA_AVX2)

constexpr int kW = 8;
using VF = __m256;
static inline VF set1(float x) { return _mm256_set1_ps(x); }
static inline VF add(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF sub(VF a, VF b) { return _mm256_sub_ps(a, b); }
static inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VF div(VF a, VF b) { return _mm256_div_ps(a, b); }
static inline VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VF vsqrt(VF a) { return _mm256_sqrt_ps(a); }
static inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
static inline float hsum(VF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline bool any_nan(VF a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }

static inline VF load_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline void store_f32(float* p, VF x) { _mm256_storeu_ps(p, x); }
static inline VF load_bf16(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline __m128i bf16_bits(VF x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
  r = _mm256_srli_epi32(r, 16);  // every lane now fits in 16 bits, so the saturating pack is exact
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline void store_bf16(uint16_t* p, VF x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x)); }
static inline VF load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline __m128i f16_bits(VF x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void store_f16(uint16_t* p, VF x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f16_bits(x)); }
static inline void stream_f32(float* p, VF x) { _mm256_stream_ps(p, x); }
static inline void stream_bf16(uint16_t* p, VF x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x)); }
static inline void stream_f16(uint16_t* p, VF x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), f16_bits(x)); }
static inline void stream_fence() { _mm_sfence(); }

static inline VF vabs(VF a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline VF load_s8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline VF load_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// The two saturating packs interleave the four vectors' 128-bit lanes; one dword permute puts them back in order.
template <bool kStream>
static inline void store_codes_x4(void* p, __m256i packed) {
  const __m256i codes = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (kStream) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), codes);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), codes);
}
static inline __m256i signed_i32(VF u, VF sign) {  // round(u), negated where sign's sign bit is set
  // psign reads sign's bits as an int32: negative exactly when the sign bit is set; it zeroes where they are all 0
  // (sign +0.0), where round(u) is 0 anyway because |sign| is what u measures.
  return _mm256_sign_epi32(_mm256_cvtps_epi32(u), _mm256_castps_si256(sign));
}
template <bool kStream = false>
static inline void store_s8x4(int8_t* p, VF u0, VF u1, VF u2, VF u3, VF s0, VF s1, VF s2, VF s3) {
  const __m256i a = _mm256_packs_epi32(signed_i32(u0, s0), signed_i32(u1, s1));
  const __m256i b = _mm256_packs_epi32(signed_i32(u2, s2), signed_i32(u3, s3));
  store_codes_x4<kStream>(p, _mm256_packs_epi16(a, b));
}
template <bool kStream = false>
static inline void store_u8x4(uint8_t* p, VF u0, VF u1, VF u2, VF u3) {
  const __m256i a = _mm256_packs_epi32(_mm256_cvtps_epi32(u0), _mm256_cvtps_epi32(u1));
  const __m256i b = _mm256_packs_epi32(_mm256_cvtps_epi32(u2), _mm256_cvtps_epi32(u3));
  store_codes_x4<kStream>(p, _mm256_packus_epi16(a, b));
}
static inline VF vmax_magnitude(VF acc, VF x) {
  return _mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(acc), _mm256_castps_si256(vabs(x))));
}
static inline VF vmax_nonneg(VF acc, VF x) {
  return _mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(acc), _mm256_castps_si256(x)));
}
static inline float hmax_magnitude(VF a) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(_mm256_castps_si256(a)),
                            _mm256_extracti128_si256(_mm256_castps_si256(a), 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
  return _mm_cvtss_f32(_mm_castsi128_ps(m));
}
static inline VF sqrt_nodiv(VF x) {  // x >= 2^-100, normal: rsqrt(0) is inf, and 0 * inf NaN
  const VF r = _mm256_rsqrt_ps(x), s = _mm256_mul_ps(x, r);  // r to 12 bits, s = x r ~ sqrt(x)
  // One Newton step on the residual, which the FMA computes exactly: s + (x - s^2) r / 2. Measured over every float
  // in [1, 4): within 2.4 ulps of the true root.
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(s, s, x), _mm256_mul_ps(r, _mm256_set1_ps(0.5f)), s);
}

#elif defined(ZO_ISA_NEON)

// AArch64 Advanced SIMD as every ARMv8.0-A core has it: no target flags, so the unit runs on any aarch64 Linux
// (Grace's Neoverse V2 and Graviton included). 128-bit vectors; a Neoverse V2 core has four such pipes, the width
// its SVE2 has too, which is why there is no SVE unit (docs/platforms.md).
//
// Where ARM and x86 semantics differ, this layer follows the x86 units (and so `tensor.to(...)`):
// - vmax is not FMAX/FMAXNM (which return the NaN, or the number): it is vmaxps's "a > b ? a : b", b when either
//   is NaN, by a compare and a bit select;
// - bf16 rounding is done in integers with the canonical NaN 0x7FC0, not by BFCVTN (ARMv8.6, which keeps NaN
//   payloads);
// - fp16 goes through FCVTL/FCVTN (base ARMv8.0): nearest-even under Linux's default FPCR, payload-keeping quiet NaN
//   like vcvtps2ph;
// - code rounding is FCVTNS/FCVTNU (nearest, ties to even, as cvtps2dq under the default MXCSR); the callers never
//   pass a NaN there (a non-finite block takes the all-zero-codes branch), where the two would differ;
// - Linux runs user code with FPCR.FZ = 0, so subnormals are kept, as on x86 with MXCSR's default.
// Streaming stores: AArch64's STNP is only a hint, and Neoverse cores have a write-streaming mode for runs of
// whole-line writes that skips fetching those lines, so the stream_* functions are plain stores (not measured on
// hardware: see docs/platforms.md).
constexpr int kW = 4;
using VF = float32x4_t;
static inline VF set1(float x) { return vdupq_n_f32(x); }
static inline VF add(VF a, VF b) { return vaddq_f32(a, b); }
static inline VF sub(VF a, VF b) { return vsubq_f32(a, b); }
static inline VF mul(VF a, VF b) { return vmulq_f32(a, b); }
static inline VF div(VF a, VF b) { return vdivq_f32(a, b); }
static inline VF fma(VF a, VF b, VF c) { return vfmaq_f32(c, a, b); }  // a * b + c
static inline VF vsqrt(VF a) { return vsqrtq_f32(a); }
static inline VF vmax(VF a, VF b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }  // b when either is NaN
static inline float hsum(VF a) { return vaddvq_f32(a); }
static inline bool any_nan(VF a) { return vminvq_u32(vceqq_f32(a, a)) == 0; }  // x == x fails only for NaN

static inline VF load_f32(const float* p) { return vld1q_f32(p); }
static inline void store_f32(float* p, VF x) { vst1q_f32(p, x); }
static inline VF load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
static inline uint16x4_t bf16_bits(VF x) {
  const uint32x4_t u = vreinterpretq_u32_f32(x);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  uint32x4_t r = vaddq_u32(u, vaddq_u32(odd, vdupq_n_u32(0x7FFF)));
  r = vbslq_u32(vceqq_f32(x, x), r, vdupq_n_u32(0x7FC00000));  // keep r where x == x, the canonical NaN elsewhere
  return vshrn_n_u32(r, 16);
}
static inline void store_bf16(uint16_t* p, VF x) { vst1_u16(p, bf16_bits(x)); }
static inline VF load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline void store_f16(uint16_t* p, VF x) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))); }
static inline void stream_f32(float* p, VF x) { store_f32(p, x); }
static inline void stream_bf16(uint16_t* p, VF x) { store_bf16(p, x); }
static inline void stream_f16(uint16_t* p, VF x) { store_f16(p, x); }
static inline void stream_fence() {}

static inline VF vabs(VF a) { return vabsq_f32(a); }
static inline VF with_sign_of(VF mag, VF sign) {  // mag must be >= 0
  return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(mag),
                                         vandq_u32(vreinterpretq_u32_f32(sign), vdupq_n_u32(0x80000000u))));
}
// Four codes are one 32-bit word: read it whole (unaligned is fine on AArch64), then widen twice.
static inline uint32x2_t four_codes(const void* p) {
  uint32_t w;
  __builtin_memcpy(&w, p, 4);
  return vdup_n_u32(w);
}
static inline VF load_s8(const int8_t* p) {
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(four_codes(p))))));
}
static inline VF load_u8(const uint8_t* p) {
  return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(four_codes(p))))));
}
// Saturating narrows keep lane order, so the four vectors' codes come out in order with no shuffle. kStream: as
// stream_f32, a plain store here.
template <bool kStream = false>
static inline void store_s8x4(int8_t* p, VF u0, VF u1, VF u2, VF u3, VF s0, VF s1, VF s2, VF s3) {
  const int16x8_t a = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(with_sign_of(u0, s0))),
                                   vqmovn_s32(vcvtnq_s32_f32(with_sign_of(u1, s1))));
  const int16x8_t b = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(with_sign_of(u2, s2))),
                                   vqmovn_s32(vcvtnq_s32_f32(with_sign_of(u3, s3))));
  vst1q_s8(p, vcombine_s8(vqmovn_s16(a), vqmovn_s16(b)));
}
template <bool kStream = false>
static inline void store_u8x4(uint8_t* p, VF u0, VF u1, VF u2, VF u3) {
  const uint16x8_t a = vcombine_u16(vqmovn_u32(vcvtnq_u32_f32(u0)), vqmovn_u32(vcvtnq_u32_f32(u1)));
  const uint16x8_t b = vcombine_u16(vqmovn_u32(vcvtnq_u32_f32(u2)), vqmovn_u32(vcvtnq_u32_f32(u3)));
  vst1q_u8(p, vcombine_u8(vqmovn_u16(a), vqmovn_u16(b)));
}
static inline VF vmax_magnitude(VF acc, VF x) {
  return vreinterpretq_f32_u32(vmaxq_u32(vreinterpretq_u32_f32(acc), vreinterpretq_u32_f32(vabs(x))));
}
static inline VF vmax_nonneg(VF acc, VF x) {
  return vreinterpretq_f32_u32(vmaxq_u32(vreinterpretq_u32_f32(acc), vreinterpretq_u32_f32(x)));
}
static inline float hmax_magnitude(VF a) {
  const uint32_t m = vmaxvq_u32(vreinterpretq_u32_f32(a));
  float f;
  __builtin_memcpy(&f, &m, 4);
  return f;
}
// The exact root: FRSQRTE is an 8-bit estimate, so matching the x86 units' accuracy would take two FRSQRTS steps
// and a residual correction, a trade that only a measurement on ARM hardware could justify; none was available.
static inline VF sqrt_nodiv(VF x) { return vsqrtq_f32(x); }

#elif defined(ZO_ISA_SCALAR)

// Portable path for every other CPU: one element at a time, conversions by bit manipulation. Plain a * b + c
// rather than fmaf, which without hardware FMA is a slow library call; the difference is an ulp, far inside the
// tolerance the tests hold every path to.
constexpr int kW = 1;
using VF = float;
static inline uint32_t bits_of(float x) { uint32_t u; __builtin_memcpy(&u, &x, 4); return u; }
static inline float float_of(uint32_t u) { float x; __builtin_memcpy(&x, &u, 4); return x; }
static inline VF set1(float x) { return x; }
static inline VF add(VF a, VF b) { return a + b; }
static inline VF sub(VF a, VF b) { return a - b; }
static inline VF mul(VF a, VF b) { return a * b; }
static inline VF div(VF a, VF b) { return a / b; }
static inline VF fma(VF a, VF b, VF c) { return a * b + c; }
static inline VF vsqrt(VF a) { return __builtin_sqrtf(a); }
static inline VF vmax(VF a, VF b) { return a > b ? a : b; }  // b when either is NaN, like vmaxps
static inline float hsum(VF a) { return a; }
static inline bool any_nan(VF a) { return a != a; }

static inline VF load_f32(const float* p) { return *p; }
static inline void store_f32(float* p, VF x) { *p = x; }
static inline VF load_bf16(const uint16_t* p) { return float_of(static_cast<uint32_t>(*p) << 16); }
static inline void store_bf16(uint16_t* p, VF x) {
  uint32_t u = bits_of(x);
  *p = (x != x) ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline VF load_f16(const uint16_t* p) {
  uint32_t h = *p, sign = (h & 0x8000u) << 16, em = h & 0x7FFFu;
  if (em >= 0x7C00u) return float_of(sign | 0x7F800000u | ((em & 0x3FFu) << 13));  // inf, nan
  if (em < 0x0400u) {                                                                 // zero, subnormal
    float v = static_cast<float>(em) * 5.9604644775390625e-8f;                       // em * 2^-24, exact
    return sign ? -v : v;
  }
  return float_of(sign | ((em << 13) + (112u << 23)));                                // rebias exponent 15 -> 127
}
static inline void store_f16(uint16_t* p, VF x) {
  uint32_t u = bits_of(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  uint32_t h;
  if (a > 0x7F800000u) {
    h = 0x7E00u;                                        // nan
  } else if (a >= 0x477FF000u) {
    h = 0x7C00u;                                        // rounds to or beyond inf
  } else if (a < 0x38800000u) {
    // Below the smallest normal half: adding 0.5 puts the value where a float's ulp equals a half subnormal's
    // (2^-24), so the FPU does the nearest-even rounding; a carry into 0x400 is the smallest normal, correctly.
    h = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
  } else {
    h = (a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23)) >> 13;
  }
  *p = static_cast<uint16_t>(sign | h);
}
static inline void stream_f32(float* p, VF x) { store_f32(p, x); }
static inline void stream_bf16(uint16_t* p, VF x) { store_bf16(p, x); }
static inline void stream_f16(uint16_t* p, VF x) { store_f16(p, x); }
static inline void stream_fence() {}

static inline VF vabs(VF a) { return float_of(bits_of(a) & 0x7FFFFFFFu); }
static inline VF with_sign_of(VF mag, VF sign) { return float_of(bits_of(mag) | (bits_of(sign) & 0x80000000u)); }
static inline VF load_s8(const int8_t* p) { return static_cast<float>(*p); }
static inline VF load_u8(const uint8_t* p) { return static_cast<float>(*p); }
// Nearest integer, ties to even, without libm: adding 1.5 * 2^23 leaves no fraction bits, so the FPU rounds (in its
// default nearest-even mode); exact for |x| < 2^22, far beyond the code range.
static inline int32_t round_i32(float x) { return static_cast<int32_t>((x + 12582912.0f) - 12582912.0f); }
static inline void store_s8(int8_t* p, VF x) {
  const int32_t i = round_i32(x);
  *p = static_cast<int8_t>(i > 127 ? 127 : i < -128 ? -128 : i);
}
static inline void store_u8(uint8_t* p, VF x) {
  const int32_t i = round_i32(x);
  *p = static_cast<uint8_t>(i > 255 ? 255 : i < 0 ? 0 : i);
}
template <bool kStream = false>  // no streaming stores here: kStream is for the vector units' signature
static inline void store_s8x4(int8_t* p, VF u0, VF u1, VF u2, VF u3, VF s0, VF s1, VF s2, VF s3) {
  store_s8(p, with_sign_of(u0, s0));
  store_s8(p + 1, with_sign_of(u1, s1));
  store_s8(p + 2, with_sign_of(u2, s2));
  store_s8(p + 3, with_sign_of(u3, s3));
}
template <bool kStream = false>
static inline void store_u8x4(uint8_t* p, VF u0, VF u1, VF u2, VF u3) {
  store_u8(p, u0);
  store_u8(p + 1, u1);
  store_u8(p + 2, u2);
  store_u8(p + 3, u3);
}
static inline VF vmax_magnitude(VF acc, VF x) {
  const uint32_t a = bits_of(acc), b = bits_of(x) & 0x7FFFFFFFu;
  return float_of(a > b ? a : b);
}
static inline VF vmax_nonneg(VF acc, VF x) {
  const uint32_t a = bits_of(acc), b = bits_of(x);
  return float_of(a > b ? a : b);
}
static inline float hmax_magnitude(VF a) { return a; }
static inline VF sqrt_nodiv(VF x) { return __builtin_sqrtf(x); }  // scalar code has no cheaper exact-enough root

#else
#error "define one of ZO_ISA_AVX512, ZO_ISA_AVX2, ZO_ISA_NEON, ZO_ISA_SCALAR before including simd.h"
#endif

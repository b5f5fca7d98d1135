// The CPU-Adam kernel's ISA units against a float64 oracle and against the scalar unit, without torch: built from
// csrc/'s kernel_args.h and isa_*.cpp unchanged, so it runs wherever a C++17 compiler does, and under qemu-aarch64
// for the NEON unit (.ci/aarch64.sh). Exit status 1 on any mismatch.
//
//   g++ -O2 -std=c++17 -Icsrc tests/native/kernel_oracle.cpp csrc/isa_*.cpp -o kernel_oracle && ./kernel_oracle
//
// Every combination of gradient dtype (fp32/bf16/fp16), state (fp32/bf16/8-bit), param_out (none/fp32/bf16/fp16),
// amsgrad, maximize, Adam/AdamW and two sets of hyperparameters (the second with 1 - beta1 >= 0.5, torch's other lerp
// form, a gradient multiplier, buffers off 64-byte alignment and, where dtypes allow, param_out in the gradient's
// memory) runs 3 steps on the SIMD tail sizes, the second step's gradient poisoned with NaN or inf in a third of the
// cases each; 278011 runs a subset. Each unit keeps its own state; every step, its result is checked against the
// oracle run in float64 from the state the unit started that step with (so a rounding that went the other way at one
// step is judged there, not compounded), and the first step is also checked against the scalar unit. The first step
// runs in place, the second and third out of place (master, moments and scales read from one set of buffers and
// written to another, then the sets swap: a ping-pong), each checked to leave the set it read untouched.
//
// What "equal" means (the tests in tests/test_state_dtypes.py hold the torch-side paths to the same):
// - param_out is exactly the unit's own master rounded to nearest-even; a bf16 NaN is the canonical 0x7FC0;
// - fp32 values within the fp32 error of the magnitudes entering them: kRel (16 fp32 ulps) of those, plus
//   assert_close's fp32 tolerance for the master;
// - bf16 values and 8-bit codes are a round-to-nearest of a value inside that error interval around the oracle's
//   (a neighbouring code only where the oracle lies within the error of a rounding boundary);
// - 8-bit scales within the error of the block's largest finite magnitude; a non-finite moment kept in its element
//   (exp_avg code -128, the block flagged by its exp_avg scale's sign bit) exactly where the oracle has one.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernel_args.h"

using zo::AdamArgs;
using zo::DType;

namespace {

constexpr double kRel = 16.0 * 1.1920928955078125e-07;
constexpr double kFltMax = 3.4028234663852886e38, kFltMin = 1.1754943508222875e-38;
constexpr int64_t kQ = zo::kQBlock;

// ---- number formats, computed independently of the kernel's bit manipulation --------------------------------------

// x rounded to nearest-even in a binary format with `digits` significant bits, smallest exponent of its spacing
// `min_exp`, largest finite value `max_finite` (beyond it: inf, as IEEE rounding gives).
double round_format(double x, int digits, int min_exp, double max_finite) {
  if (!std::isfinite(x) || x == 0.0) return x;
  int e;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const double spacing = std::ldexp(1.0, std::max(e - digits, min_exp));
  const double r = std::nearbyint(x / spacing) * spacing;  // ties to even under the default rounding mode
  return std::fabs(r) > max_finite ? std::copysign(INFINITY, x) : r;
}
double round_bf16(double x) { return round_format(x, 8, -133, 3.3895313892515355e38); }
double round_f16(double x) { return round_format(x, 11, -24, 65504.0); }

float float_of_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
uint32_t bits_of_float(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
double bf16_value(uint16_t b) { return float_of_bits(static_cast<uint32_t>(b) << 16); }  // bf16's definition
uint16_t bf16_bits(double representable) { return static_cast<uint16_t>(bits_of_float(float(representable)) >> 16); }
double f16_value(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double mag = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}
uint16_t f16_bits(double representable) {  // from the value's exponent and significand, not from float bits
  if (std::isnan(representable)) return 0x7E00;
  const uint16_t sign = std::signbit(representable) ? 0x8000 : 0;
  const double a = std::fabs(representable);
  if (std::isinf(a)) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -14)) return static_cast<uint16_t>(sign | static_cast<uint16_t>(a * 16777216.0));
  int e;
  const double f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
  return static_cast<uint16_t>(sign | ((e + 14) << 10) | static_cast<uint16_t>((2.0 * f - 1.0) * 1024.0));
}

int elem_size(DType d) { return d == DType::kF32 ? 4 : d == DType::kQ8 ? 1 : d == DType::kNone ? 0 : 2; }
const char* name_of(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kQ8: return "q8";
    default: return "none";
  }
}

// ---- the units ---------------------------------------------------------------------------------------------------

struct Unit {
  std::string name;
  void (*adam)(const AdamArgs&, int64_t, int64_t);
  zo::SqNormResult (*norm)(const void*, DType, int64_t, int64_t);
};

std::vector<Unit> units_here() {
  std::vector<Unit> out{{"scalar", zo::scalar::adam_range, zo::scalar::sq_norm_range}};
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    out.push_back({"avx2", zo::avx2::adam_range, zo::avx2::sq_norm_range});
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    out.push_back({"avx512", zo::avx512::adam_range, zo::avx512::sq_norm_range});
#endif
#if defined(__aarch64__)
  out.push_back({"neon", zo::neon::adam_range, zo::neon::sq_norm_range});
#endif
  return out;
}

// ---- buffers -----------------------------------------------------------------------------------------------------

// n elements of `size` bytes at a 64-byte boundary plus `shift` elements (0: the kernel's streaming stores apply).
struct Buf {
  std::vector<uint8_t> mem;
  uint8_t* ptr = nullptr;
  void make(int64_t n, int size, int shift) {
    mem.assign(static_cast<size_t>(n * size + 64 + shift * size + 64), 0);
    const auto base = reinterpret_cast<uintptr_t>(mem.data());
    ptr = mem.data() + ((64 - base % 64) % 64) + shift * size;
  }
  void copy_from(const Buf& o, int64_t bytes) { std::memcpy(ptr, o.ptr, static_cast<size_t>(bytes)); }
  bool same(const Buf& o, int64_t bytes) const { return std::memcmp(ptr, o.ptr, static_cast<size_t>(bytes)) == 0; }
  float* f32() { return reinterpret_cast<float*>(ptr); }
  uint16_t* u16() { return reinterpret_cast<uint16_t*>(ptr); }
};

struct Case {
  DType g, s, o;
  bool ams, maximize, decoupled;
  int hyper;   // 0: lr 1e-2, betas (0.9, 0.999), aligned; 1: lr 3e-3, betas (0.3, 0.9), multiplier 0.37, shifted
  int poison;  // 0: none, 1: NaN (with a payload, negative), 2: +inf and -inf, in the second step's gradient
  int64_t n;
};

// A unit's Adam state: master, moments (and scales for 8-bit state).
struct State {
  Buf p, m, v, x, ms, vs, xs;
  void make(const Case& c, int shift) {
    const int ss = elem_size(c.s);
    p.make(c.n, 4, shift);
    m.make(c.n, ss, shift);
    v.make(c.n, ss, shift);
    x.make(c.n, ss, shift);
    const int64_t blocks = (c.n + kQ - 1) / kQ;
    ms.make(blocks, 4, 0);
    vs.make(blocks, 4, 0);
    xs.make(blocks, 4, 0);
  }
  void copy_from(const State& o, const Case& c) {
    const int64_t ss = elem_size(c.s), blocks = (c.n + kQ - 1) / kQ;
    p.copy_from(o.p, c.n * 4);
    m.copy_from(o.m, c.n * ss);
    v.copy_from(o.v, c.n * ss);
    x.copy_from(o.x, c.n * ss);
    ms.copy_from(o.ms, blocks * 4);
    vs.copy_from(o.vs, blocks * 4);
    xs.copy_from(o.xs, blocks * 4);
  }
  bool same(const State& o, const Case& c) const {
    const int64_t ss = elem_size(c.s), blocks = (c.n + kQ - 1) / kQ;
    return p.same(o.p, c.n * 4) && m.same(o.m, c.n * ss) && v.same(o.v, c.n * ss) && x.same(o.x, c.n * ss) &&
           ms.same(o.ms, blocks * 4) && vs.same(o.vs, blocks * 4) && xs.same(o.xs, blocks * 4);
  }
};

// ---- inputs ------------------------------------------------------------------------------------------------------

// Values of mixed magnitudes (2^-12 .. 4), a few exact zeros.
double draw(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::uniform_int_distribution<int> e(-12, 2);
  return rng() % 29 == 0 ? 0.0 : std::ldexp(u(rng), e(rng));
}

void store_value(Buf& b, DType d, int64_t i, double x) {
  if (d == DType::kF32) b.f32()[i] = float(x);
  else if (d == DType::kBF16) b.u16()[i] = bf16_bits(round_bf16(x));
  else b.u16()[i] = f16_bits(round_f16(x));
}

double load_value(const uint8_t* base, DType d, int64_t i) {
  if (d == DType::kF32) return reinterpret_cast<const float*>(base)[i];
  if (d == DType::kBF16) return bf16_value(reinterpret_cast<const uint16_t*>(base)[i]);
  return f16_value(reinterpret_cast<const uint16_t*>(base)[i]);
}

void init_state(State& st, const Case& c, std::mt19937_64& rng) {
  for (int64_t i = 0; i < c.n; ++i) st.p.f32()[i] = float(std::ldexp(draw(rng), 2));
  if (c.s == DType::kQ8) {
    for (int64_t i = 0; i < c.n; ++i) {
      reinterpret_cast<int8_t*>(st.m.ptr)[i] = static_cast<int8_t>(int(rng() % 255) - 127);
      st.v.ptr[i] = static_cast<uint8_t>(rng() % 256);
      st.x.ptr[i] = std::max(st.v.ptr[i], static_cast<uint8_t>(rng() % 256));
    }
    for (int64_t b = 0; b < (c.n + kQ - 1) / kQ; ++b) {
      st.ms.f32()[b] = float(std::fabs(std::ldexp(draw(rng), -6)) + 1e-6);
      st.vs.f32()[b] = float(std::fabs(std::ldexp(draw(rng), -10)) + 1e-9);
      st.xs.f32()[b] = st.vs.f32()[b] * 2.0f;
    }
    return;
  }
  for (int64_t i = 0; i < c.n; ++i) {
    const double m = std::ldexp(draw(rng), -4), v = std::ldexp(draw(rng) * draw(rng), -6);
    store_value(st.m, c.s, i, m);
    store_value(st.v, c.s, i, std::fabs(v));
    store_value(st.x, c.s, i, std::fabs(v) * (rng() % 2 ? 1.5 : 0.5));
  }
}

void make_grad(Buf& g, const Case& c, int step, std::mt19937_64& rng) {
  for (int64_t i = 0; i < c.n; ++i) store_value(g, c.g, i, draw(rng));
  if (step != 1 || c.poison == 0) return;
  for (int64_t i = c.n / 3; i < c.n; i += 997) {  // every fresh q8 block but the first keeps a finite history
    if (c.poison == 1 && c.g == DType::kF32) g.f32()[i] = float_of_bits(0xFFA12345u);  // NaN with a payload
    else if (c.poison == 1) g.u16()[i] = c.g == DType::kBF16 ? 0xFFA1 : 0xFE21;
    else store_value(g, c.g, i, (i / 997) % 2 ? INFINITY : -INFINITY);
  }
}

// What make_args in cpu_adam.cpp gives the kernel: each scalar computed in double and rounded once.
AdamArgs args_for(const Case& c, int64_t step) {
  const double lr = c.hyper ? 3e-3 : 1e-2, b1 = c.hyper ? 0.3 : 0.9, b2 = c.hyper ? 0.9 : 0.999, eps = 1e-8;
  const double wd = c.hyper ? 0.05 : 0.1;
  AdamArgs a{};
  a.grad_dtype = c.g;
  a.state_dtype = c.s;
  a.out_dtype = c.o;
  a.grad_scale = c.hyper ? 0.37f : 1.0f;
  a.lerp_weight = float(1.0 - b1);
  a.beta2 = float(b2);
  a.one_minus_beta2 = float(1.0 - b2);
  a.step_size = float(lr / (1.0 - std::pow(b1, double(step))));
  a.inv_bc2_sqrt = float(1.0 / std::sqrt(1.0 - std::pow(b2, double(step))));
  a.eps = float(eps);
  a.decay_factor = c.decoupled ? float(1.0 - lr * wd) : 1.0f;
  a.l2_weight_decay = c.decoupled ? 0.0f : float(wd);
  a.amsgrad = c.ams;
  a.maximize = c.maximize;
  return a;
}

// ---- the oracle --------------------------------------------------------------------------------------------------

// Adam in float64 from one element's (float64) inputs, with the kernel's float scalars: the arithmetic of
// cpu_adam_kernel.h's adam_math, and the error budget of each result (kRel of the magnitudes entering it).
struct Elem {
  double p, m, v, x;         // inputs, then results
  double ep, em, ev, ex;     // error budgets of the results
  double p_in;
};

void oracle_elem(const AdamArgs& a, double graw, Elem& e) {
  e.p_in = e.p;
  const double gs = a.maximize ? -double(a.grad_scale) : double(a.grad_scale);
  const double l2 = a.l2_weight_decay != 0.0f ? e.p * double(a.l2_weight_decay) : 0.0;  // as the kernel: not NaN * 0
  const double g = graw * gs + l2;
  const double big_g = std::fabs(graw * gs) + std::fabs(l2);  // what enters g: L2 decay can cancel the gradient
  const double p = e.p * double(a.decay_factor), w = a.lerp_weight;
  const double m_old = e.m, v_old = e.v;
  const double m = w < 0.5 ? m_old + w * (g - m_old) : g - (g - m_old) * double(1.0f - a.lerp_weight);
  const double v = v_old * double(a.beta2) + double(a.one_minus_beta2) * g * g;
  const double x = a.amsgrad ? (e.x > v ? e.x : v) : v;  // vmaxps's order: v when either is NaN
  const double root = std::sqrt(x), denom = root * double(a.inv_bc2_sqrt) + double(a.eps);
  const double update = double(a.step_size) * (m / denom);
  e.em = kRel * (std::fabs(m_old) + big_g);
  e.ev = kRel * (std::fabs(v_old) + big_g * big_g);
  e.ex = a.amsgrad ? std::max(e.ev, kRel * std::fabs(e.x)) : e.ev;
  // The update's error from its inputs' (m's, and the root's through the denominator) and its own rounding.
  const double d_denom = (x > 0 ? e.ex / (2 * root) : std::sqrt(e.ex)) * double(a.inv_bc2_sqrt);
  const double d_update = double(a.step_size) * e.em / denom + std::fabs(update) * d_denom / denom;
  e.ep = 1e-5 + 1.3e-6 * std::fabs(p - update) + kRel * (std::fabs(p) + std::fabs(update)) + d_update;
  e.p = p - update;
  e.m = m;
  e.v = v;
  e.x = x;
}

// The float64 values of a unit's state: fp32/bf16 directly, 8-bit codes dequantised with their scales.
void state_values(State& st, const Case& c, std::vector<Elem>& out) {
  out.resize(c.n);
  for (int64_t i = 0; i < c.n; ++i) {
    Elem& e = out[i];
    e.p = st.p.f32()[i];
    if (c.s == DType::kQ8) {
      const int64_t b = i / kQ;
      const double cm = reinterpret_cast<int8_t*>(st.m.ptr)[i], cv = st.v.ptr[i], cx = st.x.ptr[i];
      e.m = double(std::fabs(st.ms.f32()[b])) * cm * std::fabs(cm) / (127.0 * 127.0);
      const double fv = cv / 255.0, fx = cx / 255.0;
      e.v = double(st.vs.f32()[b]) * (fv * fv) * (fv * fv);
      e.x = c.ams ? double(st.xs.f32()[b]) * (fx * fx) * (fx * fx) : 0.0;
      // A poisoned element (code -128 in a block whose exp_avg scale has its sign bit set) reads back as NaN.
      if (cm == -128 && std::signbit(st.ms.f32()[b])) e.m = NAN;
    } else {
      e.m = load_value(st.m.ptr, c.s, i);
      e.v = load_value(st.v.ptr, c.s, i);
      e.x = c.ams ? load_value(st.x.ptr, c.s, i) : 0.0;
    }
  }
}

// ---- checks ------------------------------------------------------------------------------------------------------

struct Tally {
  long checked = 0, bad = 0;
  std::string unit;
  void fail(const Case& c, int step, const char* what, int64_t i, double got, double want, double tol) {
    if (++bad <= 12)
      std::printf("MISMATCH %s grad=%s state=%s out=%s ams=%d max=%d adamw=%d hyper=%d poison=%d n=%lld step=%d "
                  "%s[%lld]: got %.9g want %.9g (tolerance %.3g)\n",
                  unit.c_str(), name_of(c.g), name_of(c.s), name_of(c.o), c.ams, c.maximize, c.decoupled, c.hyper,
                  c.poison, static_cast<long long>(c.n), step, what, static_cast<long long>(i), got, want, tol);
  }
};

// got within tol of want, with NaN and inf exactly where want has them.
bool close(double got, double want, double tol) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  if (std::isinf(want) || std::isinf(got)) return got == want;
  return std::fabs(got - want) <= tol;
}

// A stored rounded value: some nearest-even rounding (rnd) of a value within tol of want.
bool rounded_close(double got, double want, double tol, double (*rnd)(double)) {
  if (std::isnan(want) || std::isinf(want) || std::isnan(got)) return close(got, want, tol);
  return rnd(want - tol) <= got && got <= rnd(want + tol);
}

void check_moment_plain(Tally& t, const Case& c, int step, const char* what, const Buf& b, int64_t i, double want,
                        double tol) {
  ++t.checked;
  if (c.s == DType::kF32) {
    const double got = reinterpret_cast<const float*>(b.ptr)[i];
    if (!close(got, want, tol)) t.fail(c, step, what, i, got, want, tol);
    return;
  }
  const uint16_t bits = reinterpret_cast<const uint16_t*>(b.ptr)[i];
  const bool ok = std::isnan(want) ? bits == 0x7FC0 : rounded_close(bf16_value(bits), want, tol, round_bf16);
  if (!ok) t.fail(c, step, what, i, bf16_value(bits), want, tol);
}

// param_out: exactly the unit's master rounded once to nearest-even (bf16 NaN: the canonical 0x7FC0).
void check_out(Tally& t, const Case& c, int step, const Buf& out, const State& st, int64_t i) {
  if (c.o == DType::kNone) return;
  ++t.checked;
  const float p = const_cast<State&>(st).p.f32()[i];
  bool ok;
  double got;
  if (c.o == DType::kF32) {
    got = reinterpret_cast<const float*>(out.ptr)[i];
    ok = bits_of_float(float(got)) == bits_of_float(p);
  } else if (c.o == DType::kBF16) {
    const uint16_t bits = reinterpret_cast<const uint16_t*>(out.ptr)[i];
    got = bf16_value(bits);
    ok = std::isnan(p) ? bits == 0x7FC0 : bits == bf16_bits(round_bf16(p));
  } else {
    got = f16_value(reinterpret_cast<const uint16_t*>(out.ptr)[i]);
    const double want = round_f16(p);
    ok = std::isnan(p) ? std::isnan(got) : got == want && std::signbit(got) == std::signbit(want);
  }
  if (!ok) t.fail(c, step, "param_out", i, got, p, 0.0);
}

// An 8-bit code: a nearest rounding of its position on the code line for some value within tol of want, on the
// unit's own scale s (checked separately). pos(x) = top * (|x| / s)^(1/2) for exp_avg, ^(1/4) for exp_avg_sq.
bool code_ok(int code, double want, double tol, double s, double top, bool fourth_root) {
  if (!(s > 0.0)) return code == 0;
  const auto pos = [&](double x) {
    const double r = std::sqrt(std::max(x, 0.0) / s);
    return top * (fourth_root ? std::sqrt(r) : r);
  };
  const double lo = pos(std::fabs(want) - tol) - 0.5 - 1e-6, hi = pos(std::fabs(want) + tol) + 0.5 + 1e-6;
  const int mag = std::abs(code);
  if (mag < lo || mag > hi) return false;
  return code == 0 || std::fabs(want) <= tol || (code < 0) == (want < 0);
}


// One block of 8-bit state: scales against the oracle's block maxima, codes against the oracle's values.
void check_block_q8(Tally& t, const Case& c, int step, State& st, const std::vector<Elem>& want, int64_t b) {
  const int64_t lo = b * kQ, hi = std::min(c.n, lo + kQ);
  // A non-finite moment stays in its element ("poisoned": exp_avg code -128, 0 in the other codes, the block
  // flagged by the sign bit of its exp_avg scale); the block's scales come from its finite elements.
  double top_m = 0, top_v = 0, top_x = 0, tol_m = 0, tol_v = 0, tol_x = 0;
  bool flagged = false;
  const auto poisoned = [&](const Elem& e) { return !(std::fabs(e.m) <= kFltMax && e.v <= kFltMax); };
  for (int64_t i = lo; i < hi; ++i) {
    const Elem& e = want[i];
    if (poisoned(e)) {
      flagged = true;
      continue;
    }
    top_m = std::max(top_m, std::fabs(e.m));
    top_v = std::max(top_v, e.v);
    top_x = std::max(top_x, e.x);
    tol_m = std::max(tol_m, e.em);
    tol_v = std::max(tol_v, e.ev);
    tol_x = std::max(tol_x, e.ex);
  }
  const auto scale = [&](double top) { return top >= kFltMin ? top : 0.0; };
  const double sm = std::fabs(st.ms.f32()[b]), sv = st.vs.f32()[b], sx = st.xs.f32()[b];
  t.checked += c.ams ? 4 : 3;
  if (std::signbit(st.ms.f32()[b]) != flagged) t.fail(c, step, "exp_avg_scale sign (block flag)", b, st.ms.f32()[b], flagged, 0);
  if (!close(sm, scale(top_m), tol_m + kRel * top_m)) t.fail(c, step, "exp_avg_scale", b, sm, scale(top_m), tol_m);
  if (!close(sv, scale(top_v), tol_v + kRel * top_v)) t.fail(c, step, "exp_avg_sq_scale", b, sv, scale(top_v), tol_v);
  if (c.ams && !close(sx, scale(top_x), tol_x + kRel * top_x))
    t.fail(c, step, "max_exp_avg_sq_scale", b, sx, scale(top_x), tol_x);
  for (int64_t i = lo; i < hi; ++i) {
    const Elem& e = want[i];
    const int cm = reinterpret_cast<int8_t*>(st.m.ptr)[i], cv = st.v.ptr[i], cx = st.x.ptr[i];
    t.checked += c.ams ? 3 : 2;
    if (poisoned(e)) {
      if (cm != -128 || cv != 0 || (c.ams && cx != 0)) t.fail(c, step, "poisoned element's codes", i, cm, -128, 0);
      continue;
    }
    if (cm == -128) t.fail(c, step, "exp_avg code -128 (the poison mark) on a finite element", i, cm, e.m, e.em);
    if (!code_ok(cm, e.m, e.em, sm, 127.0, false)) t.fail(c, step, "exp_avg code", i, cm, e.m, e.em);
    if (!code_ok(cv, e.v, e.ev, sv, 255.0, true)) t.fail(c, step, "exp_avg_sq code", i, cv, e.v, e.ev);
    if (c.ams && !code_ok(cx, e.x, e.ex, sx, 255.0, true)) t.fail(c, step, "max_exp_avg_sq code", i, cx, e.x, e.ex);
  }
}

// A unit's state after a step against the oracle's results (want), element by element.
void check_state(Tally& t, const Case& c, int step, State& st, const Buf& out, const std::vector<Elem>& want) {
  for (int64_t i = 0; i < c.n; ++i) {
    const Elem& e = want[i];
    ++t.checked;
    if (!close(st.p.f32()[i], e.p, e.ep)) t.fail(c, step, "param", i, st.p.f32()[i], e.p, e.ep);
    check_out(t, c, step, out, st, i);
    if (c.s == DType::kQ8) continue;
    check_moment_plain(t, c, step, "exp_avg", st.m, i, e.m, e.em);
    check_moment_plain(t, c, step, "exp_avg_sq", st.v, i, e.v, e.ev);
    if (c.ams) check_moment_plain(t, c, step, "max_exp_avg_sq", st.x, i, e.x, e.ex);
  }
  if (c.s == DType::kQ8)
    for (int64_t b = 0; b < (c.n + kQ - 1) / kQ; ++b) check_block_q8(t, c, step, st, want, b);
}

// The squared norm and non-finite flag of the step's gradient.
void check_norm(Tally& t, const Case& c, int step, const Unit& u, const Buf& grad) {
  double want = 0;
  bool bad = false;
  for (int64_t i = 0; i < c.n; ++i) {
    const double g = load_value(grad.ptr, c.g, i);
    bad = bad || !std::isfinite(g);
    want += g * g;
  }
  const zo::SqNormResult got = u.norm(grad.ptr, c.g, 0, c.n);
  t.checked += 2;
  if (got.nonfinite != bad) t.fail(c, step, "norm nonfinite flag", 0, got.nonfinite, bad, 0);
  if (!bad && !close(got.sum_sq, want, 1e-5 * want)) t.fail(c, step, "norm sum_sq", 0, got.sum_sq, want, 1e-5 * want);
}

// Finite values whose squares overflow fp32: an infinite sum (as torch's fp32 norm gives), but no non-finite flag.
void check_norm_overflow(Tally& t, const Unit& u) {
  Buf g;
  g.make(37, 4, 0);
  for (int i = 0; i < 37; ++i) g.f32()[i] = 1e20f;
  const zo::SqNormResult r = u.norm(g.ptr, DType::kF32, 0, 37);
  const Case c{DType::kF32, DType::kF32, DType::kNone, false, false, true, 0, 0, 37};
  t.checked += 1;
  if (r.nonfinite || !std::isinf(r.sum_sq)) t.fail(c, 0, "norm of finite overflowing squares", 0, r.sum_sq, INFINITY, 0);
}

// Points the kernel's sources at `src` and its destinations at `dst` (the same state: in place).
void point(AdamArgs& a, const Case& c, State& src, State& dst) {
  a.param_in = src.p.f32();
  a.param = dst.p.f32();
  a.exp_avg_in = src.m.ptr;
  a.exp_avg = dst.m.ptr;
  a.exp_avg_sq_in = src.v.ptr;
  a.exp_avg_sq = dst.v.ptr;
  a.max_exp_avg_sq_in = c.ams ? src.x.ptr : nullptr;
  a.max_exp_avg_sq = c.ams ? dst.x.ptr : nullptr;
  if (c.s == DType::kQ8) {
    a.exp_avg_scale_in = src.ms.f32();
    a.exp_avg_scale = dst.ms.f32();
    a.exp_avg_sq_scale_in = src.vs.f32();
    a.exp_avg_sq_scale = dst.vs.f32();
    a.max_exp_avg_sq_scale_in = c.ams ? src.xs.f32() : nullptr;
    a.max_exp_avg_sq_scale = c.ams ? dst.xs.f32() : nullptr;
  }
}

// One unit's step: run the kernel in two ranges as the dispatcher may split it, the oracle from the state the unit
// started with, then the checks. Out of place (spare given), the update goes into spare, the state it read is
// checked unchanged, and the two swap, so that st holds the result either way.
void run_step(Tally& t, const Unit& u, const Case& c, int step, State& st, State* spare, const Buf& grad, Buf& work,
              Buf& out, std::vector<Elem>& want) {
  state_values(st, c, want);
  const bool alias = c.hyper == 1 && c.o == c.g;
  work.copy_from(grad, c.n * elem_size(c.g));
  AdamArgs a = args_for(c, 10 + step);
  point(a, c, st, spare ? *spare : st);
  a.grad = work.ptr;
  a.param_out = c.o == DType::kNone ? nullptr : alias ? work.ptr : out.ptr;
  State before;
  if (spare) {
    before.make(c, c.hyper);
    before.copy_from(st, c);
  }
  // 8-bit state: at a multiple of the dispatcher's 1024-element blocks, as adam_step splits; other states also at an
  // odd element, as adam_step_segments can (a thread's range starting mid-vector in a segment).
  const int64_t split = c.s == DType::kQ8 ? (c.n >= 2048 ? (c.n / 2) / 1024 * 1024 : 0) : (c.n > 2 ? (c.n / 2) | 1 : 0);
  if (split) u.adam(a, 0, split);
  u.adam(a, split, c.n);
  if (spare) {
    ++t.checked;
    if (!st.same(before, c)) t.fail(c, step, "the source set (out of place), written", 0, 1, 0, 0);
    std::swap(st, *spare);
  }
  for (int64_t i = 0; i < c.n; ++i) oracle_elem(a, load_value(grad.ptr, c.g, i), want[i]);
  check_state(t, c, step, st, alias ? work : out, want);
  check_norm(t, c, step, u, grad);
}

// After the first step (same inputs), a SIMD unit against the scalar unit: within both units' error budgets.
void check_against_scalar(Tally& t, const Case& c, State& st, State& ref, const std::vector<Elem>& want) {
  for (int64_t i = 0; i < c.n; ++i) {
    const Elem& e = want[i];
    ++t.checked;
    if (!close(st.p.f32()[i], ref.p.f32()[i], 2 * e.ep)) t.fail(c, 0, "param vs scalar", i, st.p.f32()[i],
                                                                ref.p.f32()[i], 2 * e.ep);
    if (c.s == DType::kQ8) {
      const int dm = std::abs(int(reinterpret_cast<int8_t*>(st.m.ptr)[i]) - reinterpret_cast<int8_t*>(ref.m.ptr)[i]);
      const int dv = std::abs(int(st.v.ptr[i]) - int(ref.v.ptr[i]));
      if (dm > 1 || dv > 1) t.fail(c, 0, "codes vs scalar (exp_avg, exp_avg_sq)", i, dm, dv, 1);
      continue;
    }
    const double m = load_value(st.m.ptr, c.s, i), rm = load_value(ref.m.ptr, c.s, i);
    const double v = load_value(st.v.ptr, c.s, i), rv = load_value(ref.v.ptr, c.s, i);
    const double ulp = c.s == DType::kBF16 ? 1.0 / 128 : 0.0;  // a bf16 neighbour, where both sit by a boundary
    if (!close(m, rm, 2 * e.em + ulp * std::fabs(rm))) t.fail(c, 0, "exp_avg vs scalar", i, m, rm, 2 * e.em);
    if (!close(v, rv, 2 * e.ev + ulp * std::fabs(rv))) t.fail(c, 0, "exp_avg_sq vs scalar", i, v, rv, 2 * e.ev);
  }
}

// A case on every unit: each from the same initial state, through 3 steps with the same gradients.
void run_case(std::vector<Tally>& tallies, const std::vector<Unit>& units, const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int shift = c.hyper;
  State init;
  init.make(c, shift);
  init_state(init, c, rng);
  std::vector<State> states(units.size()), spares(units.size());
  for (auto& st : states) {
    st.make(c, shift);
    st.copy_from(init, c);
  }
  for (auto& st : spares) st.make(c, shift);
  Buf grad, work, out;
  grad.make(c.n, elem_size(c.g), shift);
  work.make(c.n, elem_size(c.g), shift);
  out.make(c.n, std::max(elem_size(c.o), 1), shift);
  std::vector<Elem> want, want0;
  for (int step = 0; step < 3; ++step) {
    make_grad(grad, c, step, rng);
    for (size_t k = 0; k < units.size(); ++k) {
      run_step(tallies[k], units[k], c, step, states[k], step == 0 ? nullptr : &spares[k], grad, work, out, want);
      if (step == 0 && k == 0) want0 = want;
      if (step == 0 && k > 0) check_against_scalar(tallies[k], c, states[k], states[0], want0);
    }
  }
}

std::vector<Case> all_cases() {
  const DType grads[] = {DType::kF32, DType::kBF16, DType::kF16};
  const DType states[] = {DType::kF32, DType::kBF16, DType::kQ8};
  const DType outs[] = {DType::kNone, DType::kF32, DType::kBF16, DType::kF16};
  std::vector<Case> cases;
  int k = 0;
  for (int64_t n : {1, 7, 15, 17, 4097, 278011})
    for (DType g : grads)
      for (DType s : states)
        for (DType o : outs)
          for (int bits = 0; bits < 16; ++bits, ++k) {
            const Case c{g, s, o, bool(bits & 1), bool(bits & 2), bool(bits & 4), (bits >> 3) & 1, k % 3, n};
            // The largest size on a subset (emulation is slow): each gradient x state pair once, the output dtype
            // and the modes cycling with it.
            if (n == 278011 && (o != outs[(k / 64) % 4] || bits != (k / 64) % 16)) continue;
            cases.push_back(c);
          }
  return cases;
}

}  // namespace

int main(int argc, char** argv) {
  const long limit = argc > 1 ? std::atol(argv[1]) : -1;  // optional: run only the first N cases (a smoke run)
  const std::vector<Unit> units = units_here();
  std::vector<Tally> tallies(units.size());
  for (size_t k = 0; k < units.size(); ++k) tallies[k].unit = units[k].name;
  const std::vector<Case> cases = all_cases();
  long done = 0;
  for (const Case& c : cases) {
    if (limit >= 0 && done >= limit) break;
    run_case(tallies, units, c, 1234567 + done++);
  }
  for (size_t k = 0; k < units.size(); ++k) check_norm_overflow(tallies[k], units[k]);
  long bad = 0;
  for (const Tally& t : tallies) {
    std::printf("%-7s %ld cases x 3 steps, %ld values checked, %ld mismatches\n", t.unit.c_str(), done, t.checked,
                t.bad);
    bad += t.bad;
  }
  std::printf("%s\n", bad ? "FAILED" : "OK");
  return bad ? 1 : 0;
}

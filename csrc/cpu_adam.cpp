// Dispatcher for the CPU-Adam kernel: checks every tensor at the boundary (Python validates first and gives the
// friendlier message; these checks keep the C++ entry safe on its own), picks the ISA unit, and splits the
// buffer over torch's intra-op thread pool so torch.set_num_threads is honoured.
#include "cpu_adam.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>

#include "kernel_args.h"

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace zo {
namespace {

// Work is split into blocks of this many elements (a multiple of every vector width and of a 64-byte line for
// every dtype); a thread gets whole blocks, and buffers under kGrainBlocks blocks run on the calling thread.
constexpr int64_t kBlock = 1024;
constexpr int64_t kGrainBlocks = 32;

using AdamRangeFn = void (*)(const AdamArgs&, int64_t, int64_t);
using SqNormRangeFn = SqNormResult (*)(const void*, DType, int64_t, int64_t);

struct IsaEntry {
  const char* name;
  bool (*supported)();
  AdamRangeFn adam;
  SqNormRangeFn sq_norm;
};

#if defined(__x86_64__) || defined(_M_X64)
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
}
bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif
#if defined(__aarch64__)
// AdvSIMD is in every AArch64 core Linux runs on, but the kernel says so in HWCAP: ask rather than assume.
bool cpu_has_neon() { return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0; }
#endif
bool always() { return true; }

const std::vector<IsaEntry>& isa_table() {
  static const std::vector<IsaEntry> table = {
#if defined(__x86_64__) || defined(_M_X64)
      {"avx512", cpu_has_avx512, avx512::adam_range, avx512::sq_norm_range},
      {"avx2", cpu_has_avx2, avx2::adam_range, avx2::sq_norm_range},
#endif
#if defined(__aarch64__)
      {"neon", cpu_has_neon, neon::adam_range, neon::sq_norm_range},
#endif
      {"scalar", always, scalar::adam_range, scalar::sq_norm_range},
  };
  return table;
}

const IsaEntry& find_isa(const std::string& name) {
  for (const auto& e : isa_table()) {
    if (name == e.name) {
      TORCH_CHECK(e.supported(), "zero_offload: ISA '", name, "' is compiled in but this CPU does not support it");
      return e;
    }
  }
  TORCH_CHECK(false, "zero_offload: ISA '", name, "' is not compiled into this build (available: ",
              c10::Join(", ", available_isas()), ")");
}

DType to_dtype(const at::Tensor& t, const char* what, bool allow_f16) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf:
      if (allow_f16) return DType::kF16;
      [[fallthrough]];
    default:
      TORCH_CHECK(false, "zero_offload: unsupported dtype ", t.scalar_type(), " for ", what);
  }
}

void check_buffer(const at::Tensor& t, const char* what, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "zero_offload: ", what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "zero_offload: ", what, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "zero_offload: ", what, " has ", t.numel(), " elements, param has ", numel);
  TORCH_CHECK(!t.is_sparse(), "zero_offload: ", what, " must be dense");
}

}  // namespace

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (const auto& e : isa_table())
    if (e.supported()) out.emplace_back(e.name);
  return out;
}

namespace {

// The optional per-block scales of 8-bit state.
struct Scales {
  std::optional<at::Tensor> exp_avg, exp_avg_sq, max_exp_avg_sq;
};

void check_scale(const std::optional<at::Tensor>& t, const char* what, int64_t numel) {
  TORCH_CHECK(t.has_value(), "zero_offload: 8-bit state needs ", what, " (one float32 per ", kQBlock, " elements)");
  TORCH_CHECK(t->scalar_type() == at::kFloat, "zero_offload: ", what, " must be float32, got ", t->scalar_type());
  check_buffer(*t, what, (numel + kQBlock - 1) / kQBlock);
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto lo_a = reinterpret_cast<uintptr_t>(a.data_ptr()), lo_b = reinterpret_cast<uintptr_t>(b.data_ptr());
  return lo_a < lo_b + b.nbytes() && lo_b < lo_a + a.nbytes() && a.nbytes() && b.nbytes();
}

// param_out may share the gradient's memory exactly (same start, same element size: each slot is read as a
// gradient before it is written as the parameter); any other overlap would let one thread's writes land in
// another's unread gradients.
void check_out_vs_grad(const at::Tensor& out, const at::Tensor& grad, int64_t offset, const char* what) {
  const auto base = static_cast<const uint8_t*>(out.data_ptr()) + offset * out.element_size();
  const auto g = grad.numel() ? static_cast<const uint8_t*>(grad.data_ptr()) : nullptr;
  if (g == base && grad.element_size() == out.element_size()) return;
  TORCH_CHECK(!overlaps(out, grad), "zero_offload: param_out overlaps ", what, " without being exactly its memory ",
              "(param_out may alias the gradient only slot for slot, with the same element size)");
}

// The buffers an update reads, by the names the out-set uses, in AdamArgs' order: (name, tensor or null).
using Sources = std::vector<std::pair<const char*, const at::Tensor*>>;

Sources sources_of(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                   const std::optional<at::Tensor>& max_exp_avg_sq, const Scales& scales) {
  const auto opt = [](const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; };
  return {{"param", &param}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq},
          {"max_exp_avg_sq", opt(max_exp_avg_sq)}, {"exp_avg_scale", opt(scales.exp_avg)},
          {"exp_avg_sq_scale", opt(scales.exp_avg_sq)}, {"max_exp_avg_sq_scale", opt(scales.max_exp_avg_sq)}};
}

// The destination of every source of an out-of-place update: one per source, by its name, with its size and
// dtype, each either the source itself (that buffer in place) or sharing no byte with any source, other
// destination or param_out. A partial overlap would let the vector loop read what it has just written.
std::vector<const at::Tensor*> check_out(const OutSet& out, const Sources& sources,
                                         const std::optional<at::Tensor>& param_out) {
  for (const auto& [key, t] : *out) {
    const bool known = std::any_of(sources.begin(), sources.end(),
                                   [&](const auto& s) { return s.second != nullptr && key == s.first; });
    TORCH_CHECK(known, "zero_offload: out['", key, "'] is not a buffer this update writes");
  }
  std::vector<const at::Tensor*> dst(sources.size(), nullptr);
  for (size_t k = 0; k < sources.size(); ++k) {
    const auto& [name, src] = sources[k];
    if (src == nullptr) continue;
    const auto it = out->find(name);
    TORCH_CHECK(it != out->end(), "zero_offload: out lacks '", name, "' (an out-of-place update needs a "
                "destination for every buffer it writes)");
    const at::Tensor& d = it->second;
    const std::string what = std::string("out['") + name + "']";
    check_buffer(d, what.c_str(), src->numel());
    TORCH_CHECK(d.scalar_type() == src->scalar_type(), "zero_offload: ", what, " is ", d.scalar_type(), ", ", name,
                " is ", src->scalar_type());
    for (size_t j = 0; j < sources.size(); ++j) {
      const at::Tensor* other = sources[j].second;
      if (other == nullptr || !overlaps(d, *other)) continue;
      TORCH_CHECK(j == k && d.data_ptr() == other->data_ptr(), "zero_offload: ", what, " overlaps ",
                  sources[j].first, " (a destination is either its own source, exactly, or disjoint from every "
                  "source)");
    }
    for (size_t j = 0; j < k; ++j)
      TORCH_CHECK(dst[j] == nullptr || !overlaps(d, *dst[j]), "zero_offload: ", what, " overlaps out['",
                  sources[j].first, "']");
    TORCH_CHECK(!param_out.has_value() || !overlaps(d, *param_out), "zero_offload: ", what, " overlaps param_out");
    dst[k] = &d;
  }
  return dst;
}

// Points the destinations of `a` at the out-set (checked by check_out; one per source, null where none).
void point_out(AdamArgs& a, const std::vector<const at::Tensor*>& dst) {
  const auto ptr = [](const at::Tensor* t) { return t == nullptr ? nullptr : t->data_ptr(); };
  a.param = static_cast<float*>(ptr(dst[0]));
  a.exp_avg = ptr(dst[1]);
  a.exp_avg_sq = ptr(dst[2]);
  a.max_exp_avg_sq = ptr(dst[3]);
  a.exp_avg_scale = static_cast<float*>(ptr(dst[4]));
  a.exp_avg_sq_scale = static_cast<float*>(ptr(dst[5]));
  a.max_exp_avg_sq_scale = static_cast<float*>(ptr(dst[6]));
}

// A gradient against the out-set's destinations: no overlap at all (the kernel reads the gradient while it writes
// them).
void check_out_vs_grad_all(const OutSet& out, const at::Tensor& grad, const char* what) {
  if (!out.has_value()) return;
  for (const auto& [key, d] : *out)
    TORCH_CHECK(!overlaps(d, grad), "zero_offload: out['", key, "'] overlaps ", what);
}

// Checks the flat buffers of an update and fills every field of AdamArgs but the gradient, which
// the caller checks and points (one buffer for adam_step, one per segment for adam_step_segments). Without an
// out-set, every destination is its source (in place).
AdamArgs make_args(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                   const std::optional<at::Tensor>& max_exp_avg_sq, const std::optional<at::Tensor>& param_out,
                   const Scales& scales, const OutSet& out, int64_t step, double lr, double beta1, double beta2,
                   double eps, double weight_decay, bool decoupled_weight_decay, bool maximize, double grad_scale) {
  const int64_t n = param.numel();
  TORCH_CHECK(param.scalar_type() == at::kFloat, "zero_offload: param (the master) must be float32");
  check_buffer(param, "param", n);
  check_buffer(exp_avg, "exp_avg", n);
  check_buffer(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(step >= 1, "zero_offload: step must be >= 1, got ", step);

  AdamArgs a{};
  a.param = param.data_ptr<float>();
  a.exp_avg = exp_avg.data_ptr();
  a.exp_avg_sq = exp_avg_sq.data_ptr();
  a.out_dtype = DType::kNone;
  const bool q8 = exp_avg.scalar_type() == at::kChar;
  if (q8) {
    TORCH_CHECK(exp_avg_sq.scalar_type() == at::kByte, "zero_offload: 8-bit state needs a uint8 exp_avg_sq, got ",
                exp_avg_sq.scalar_type());
    a.state_dtype = DType::kQ8;
    check_scale(scales.exp_avg, "exp_avg_scale", n);
    check_scale(scales.exp_avg_sq, "exp_avg_sq_scale", n);
    a.exp_avg_scale = scales.exp_avg->data_ptr<float>();
    a.exp_avg_sq_scale = scales.exp_avg_sq->data_ptr<float>();
  } else {
    TORCH_CHECK(exp_avg.scalar_type() == exp_avg_sq.scalar_type(), "zero_offload: exp_avg and exp_avg_sq dtypes differ");
    a.state_dtype = to_dtype(exp_avg, "exp_avg", false);
    TORCH_CHECK(!scales.exp_avg && !scales.exp_avg_sq && !scales.max_exp_avg_sq,
                "zero_offload: scales are for 8-bit state only (exp_avg is ", exp_avg.scalar_type(), ")");
  }
  if (max_exp_avg_sq.has_value()) {
    check_buffer(*max_exp_avg_sq, "max_exp_avg_sq", n);
    TORCH_CHECK(max_exp_avg_sq->scalar_type() == exp_avg_sq.scalar_type(),
                "zero_offload: max_exp_avg_sq dtype differs from exp_avg_sq");
    a.max_exp_avg_sq = max_exp_avg_sq->data_ptr();
    if (q8) {
      check_scale(scales.max_exp_avg_sq, "max_exp_avg_sq_scale", n);
      a.max_exp_avg_sq_scale = scales.max_exp_avg_sq->data_ptr<float>();
    }
    a.amsgrad = true;
  } else {
    TORCH_CHECK(!scales.max_exp_avg_sq, "zero_offload: max_exp_avg_sq_scale given without max_exp_avg_sq");
  }
  if (param_out.has_value()) {
    check_buffer(*param_out, "param_out", n);
    a.out_dtype = to_dtype(*param_out, "param_out", true);
    a.param_out = param_out->data_ptr();
  }
  // Bias corrections in double, as torch computes them from the Python step; each scalar is rounded once.
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  a.grad_scale = static_cast<float>(grad_scale);
  a.lerp_weight = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.step_size = static_cast<float>(lr / bc1);
  a.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  a.eps = static_cast<float>(eps);
  a.decay_factor = decoupled_weight_decay ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  a.l2_weight_decay = decoupled_weight_decay ? 0.0f : static_cast<float>(weight_decay);
  a.maximize = maximize;
  a.param_in = a.param;
  a.exp_avg_in = a.exp_avg;
  a.exp_avg_sq_in = a.exp_avg_sq;
  a.max_exp_avg_sq_in = a.max_exp_avg_sq;
  a.exp_avg_scale_in = a.exp_avg_scale;
  a.exp_avg_sq_scale_in = a.exp_avg_sq_scale;
  a.max_exp_avg_sq_scale_in = a.max_exp_avg_sq_scale;
  if (out.has_value())
    point_out(a, check_out(out, sources_of(param, exp_avg, exp_avg_sq, max_exp_avg_sq, scales), param_out));
  return a;
}

// The same args with every buffer pointer moved `offset` elements on, so the range function indexes from there.
// For 8-bit state, offset is a multiple of kQBlock and the scales move offset / kQBlock.
AdamArgs shifted(const AdamArgs& a, int64_t offset) {
  const auto move = [offset](void* base, DType d) -> void* {
    if (base == nullptr) return nullptr;
    return static_cast<uint8_t*>(base) + offset * (d == DType::kF32 ? 4 : d == DType::kQ8 ? 1 : 2);
  };
  const auto move_in = [&move](const void* base, DType d) -> const void* {
    return move(const_cast<void*>(base), d);
  };
  const auto move_scale = [offset](float* base) { return base == nullptr ? nullptr : base + offset / kQBlock; };
  const auto move_scale_in = [offset](const float* base) {
    return base == nullptr ? nullptr : base + offset / kQBlock;
  };
  AdamArgs s = a;
  s.param = a.param + offset;
  s.param_in = a.param_in + offset;
  s.exp_avg = move(a.exp_avg, a.state_dtype);
  s.exp_avg_in = move_in(a.exp_avg_in, a.state_dtype);
  s.exp_avg_sq = move(a.exp_avg_sq, a.state_dtype);
  s.exp_avg_sq_in = move_in(a.exp_avg_sq_in, a.state_dtype);
  s.max_exp_avg_sq = move(a.max_exp_avg_sq, a.state_dtype);
  s.max_exp_avg_sq_in = move_in(a.max_exp_avg_sq_in, a.state_dtype);
  s.param_out = move(a.param_out, a.out_dtype);
  s.exp_avg_scale = move_scale(a.exp_avg_scale);
  s.exp_avg_scale_in = move_scale_in(a.exp_avg_scale_in);
  s.exp_avg_sq_scale = move_scale(a.exp_avg_sq_scale);
  s.exp_avg_sq_scale_in = move_scale_in(a.exp_avg_sq_scale_in);
  s.max_exp_avg_sq_scale = move_scale(a.max_exp_avg_sq_scale);
  s.max_exp_avg_sq_scale_in = move_scale_in(a.max_exp_avg_sq_scale_in);
  return s;
}

}  // namespace

void adam_step(const std::string& isa, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
               const std::optional<at::Tensor>& param_out, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool decoupled_weight_decay, bool maximize, double grad_scale,
               const std::optional<at::Tensor>& exp_avg_scale, const std::optional<at::Tensor>& exp_avg_sq_scale,
               const std::optional<at::Tensor>& max_exp_avg_sq_scale, const OutSet& out) {
  const IsaEntry& entry = find_isa(isa);
  const int64_t n = param.numel();
  AdamArgs a = make_args(param, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out,
                         Scales{exp_avg_scale, exp_avg_sq_scale, max_exp_avg_sq_scale}, out, step, lr, beta1, beta2,
                         eps, weight_decay, decoupled_weight_decay, maximize, grad_scale);
  check_buffer(grad, "grad", n);
  if (param_out.has_value()) check_out_vs_grad(*param_out, grad, 0, "grad");
  check_out_vs_grad_all(out, grad, "grad");
  a.grad = grad.data_ptr();
  a.grad_dtype = to_dtype(grad, "grad", true);

  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    entry.adam(a, b0 * kBlock, std::min(b1 * kBlock, n));
  });
}

void adam_step_segments(const std::string& isa, const at::Tensor& param, const std::vector<at::Tensor>& grads,
                        const std::vector<int64_t>& offsets, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                        const std::optional<at::Tensor>& max_exp_avg_sq, const std::optional<at::Tensor>& param_out,
                        int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                        bool decoupled_weight_decay, bool maximize, double grad_scale,
                        const std::optional<at::Tensor>& exp_avg_scale,
                        const std::optional<at::Tensor>& exp_avg_sq_scale,
                        const std::optional<at::Tensor>& max_exp_avg_sq_scale, const OutSet& out) {
  const IsaEntry& entry = find_isa(isa);
  const int64_t n = param.numel();
  const AdamArgs a = make_args(param, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out,
                               Scales{exp_avg_scale, exp_avg_sq_scale, max_exp_avg_sq_scale}, out, step, lr, beta1,
                               beta2, eps, weight_decay, decoupled_weight_decay, maximize, grad_scale);
  TORCH_CHECK(grads.size() == offsets.size(), "zero_offload: ", grads.size(), " grads but ", offsets.size(),
              " offsets");
  const size_t count = grads.size();
  if (count == 0) return;
  const DType grad_dtype = to_dtype(grads[0], "grads[0]", true);
  std::vector<int64_t> ends(count);
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& g = grads[i];
    check_buffer(g, "grads[i]", g.numel());
    TORCH_CHECK(g.scalar_type() == grads[0].scalar_type(), "zero_offload: grads[", i, "] is ", g.scalar_type(),
                ", grads[0] is ", grads[0].scalar_type());
    TORCH_CHECK(offsets[i] >= (i == 0 ? 0 : ends[i - 1]), "zero_offload: segment ", i, " at offset ", offsets[i],
                " starts before the previous one ends (segments must be sorted and must not overlap)");
    ends[i] = offsets[i] + g.numel();
    TORCH_CHECK(ends[i] <= n, "zero_offload: segment ", i, " ends at ", ends[i], ", past the buffer's ", n,
                " elements");
    // A segment of 8-bit state must own its scale blocks: one starting mid-block would rescale codes it does not
    // update.
    TORCH_CHECK(a.state_dtype != DType::kQ8 || offsets[i] % kQBlock == 0, "zero_offload: segment ", i,
                " starts at offset ", offsets[i], ", not a multiple of ", kQBlock, " (8-bit state needs whole blocks)");
    if (param_out.has_value()) check_out_vs_grad(*param_out, g, offsets[i], "a gradient");
    check_out_vs_grad_all(out, g, "a gradient");
  }

  // Threads split the flat range from the first segment to the end of the last as adam_step splits a buffer, so
  // the work is balanced however it is cut into tensors; each thread runs the segments its range overlaps,
  // clipped to it. Results do not depend on the cut: a tail gets the same vector code as the body.
  const int64_t base = offsets[0], span = ends[count - 1] - base;
  const int64_t blocks = (span + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    const int64_t lo = base + b0 * kBlock, hi = base + std::min(b1 * kBlock, span);
    // First segment ending after lo.
    size_t s = std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin();
    for (; s < count && offsets[s] < hi; ++s) {
      const int64_t begin = std::max(lo, offsets[s]), end = std::min(hi, ends[s]);
      if (begin >= end) continue;
      AdamArgs sa = shifted(a, offsets[s]);
      sa.grad = grads[s].data_ptr();
      sa.grad_dtype = grad_dtype;
      entry.adam(sa, begin - offsets[s], end - offsets[s]);
    }
  });
}

std::tuple<double, bool> grad_sq_norm(const std::string& isa, const at::Tensor& grad) {
  const IsaEntry& entry = find_isa(isa);
  check_buffer(grad, "grad", grad.numel());
  const DType dtype = to_dtype(grad, "grad", true);
  const void* data = grad.data_ptr();
  const int64_t n = grad.numel();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  // Partial results per block range, combined in a fixed order so the result does not depend on thread timing.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks / kGrainBlocks));
  std::vector<SqNormResult> parts(chunks, SqNormResult{0.0, false});
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * blocks / chunks, e = (c + 1) * blocks / chunks;
      parts[c] = entry.sq_norm(data, dtype, b * kBlock, std::min(e * kBlock, n));
    }
  });
  double total = 0.0;
  bool nonfinite = false;
  for (const auto& p : parts) {
    total += p.sum_sq;
    nonfinite = nonfinite || p.nonfinite;
  }
  return {total, nonfinite};
}

std::tuple<double, bool> grad_sq_norm_segments(const std::string& isa, const std::vector<at::Tensor>& grads) {
  const IsaEntry& entry = find_isa(isa);
  struct Piece {
    const void* data;
    DType dtype;
    int64_t begin, end;
  };
  // Fixed-size pieces, each its own partial result summed in list order: the result depends on neither thread
  // timing nor thread count, and many small tensors still spread over the threads.
  constexpr int64_t kPiece = kBlock * kGrainBlocks;
  std::vector<Piece> pieces;
  int64_t total_numel = 0;
  for (const at::Tensor& g : grads) {
    check_buffer(g, "grad", g.numel());
    const DType dtype = to_dtype(g, "grad", true);
    const int64_t n = g.numel();
    for (int64_t b = 0; b < n; b += kPiece) pieces.push_back(Piece{g.data_ptr(), dtype, b, std::min(b + kPiece, n)});
    total_numel += n;
  }
  std::vector<SqNormResult> parts(pieces.size(), SqNormResult{0.0, false});
  const auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const Piece& q = pieces[p];
      parts[p] = entry.sq_norm(q.data, q.dtype, q.begin, q.end);
    }
  };
  if (total_numel < kPiece) {
    run(0, static_cast<int64_t>(pieces.size()));
  } else {
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, run);
  }
  double total = 0.0;
  bool nonfinite = false;
  for (const auto& p : parts) {
    total += p.sum_sq;
    nonfinite = nonfinite || p.nonfinite;
  }
  return {total, nonfinite};
}

std::vector<int64_t> pin_team(const std::vector<int64_t>& cpus) {
#if defined(__linux__)
  TORCH_CHECK(!cpus.empty(), "zero_offload: pin_team needs at least one CPU");
  for (int64_t c : cpus) {
    TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "zero_offload: pin_team: no CPU ", c);
  }
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> bound(n, -1);
  std::vector<int> errors(n, 0);
  // One index per team thread: with the range equal to the team's size and a grain of 1, at::parallel_for gives
  // thread t exactly index t (at::get_thread_num()), so each thread binds itself (pid 0: the calling thread).
  at::parallel_for(0, n, 1, [&](int64_t b0, int64_t b1) {
    const int64_t t = at::get_thread_num();
    if (t <= 0 || t >= n || b1 - b0 != 1) {
      return;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[(t - 1) % cpus.size()]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      errors[t] = errno;
      return;
    }
    cpu_set_t now;
    if (sched_getaffinity(0, sizeof(now), &now) == 0 && CPU_COUNT(&now) == 1) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &now)) {
          bound[t] = c;
          break;
        }
      }
    }
  });
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(errors[t] == 0, "zero_offload: could not bind kernel thread ", t, " to CPU ",
                cpus[(t - 1) % cpus.size()], " (errno ", errors[t], ")");
  }
  return bound;
#else
  (void)cpus;
  TORCH_CHECK(false, "zero_offload: binding the kernel's threads to CPUs is only implemented on Linux");
  return {};
#endif
}

}  // namespace zo

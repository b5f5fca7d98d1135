// The ATen-facing side of the kernel: argument checks, ISA detection and choice, threading.
#pragma once
// ATen's Tensor alone, not <torch/extension.h> (all of torch's C++ API): 7 s to compile this and cpu_adam.cpp
// instead of 55 s (2-core x86, g++ -O3).
#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace zo {

// 8-bit state (int8 exp_avg, uint8 exp_avg_sq / max_exp_avg_sq) takes one float32 scale per kQBlock (64) elements
// in the *_scale tensors, which must be absent for fp32/bf16 state. param_out may be the gradient's own memory.

// The destinations of an out-of-place update by name ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq",
// "exp_avg_scale", "exp_avg_sq_scale", "max_exp_avg_sq_scale"): one for every buffer the update writes, each
// either that buffer itself or disjoint from every buffer the update reads. Absent: the update is in place.
using OutSet = std::optional<std::map<std::string, at::Tensor>>;

// ISAs compiled into this build and supported by the running CPU, best first ("scalar" always last).
std::vector<std::string> available_isas();

void adam_step(const std::string& isa, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
               const std::optional<at::Tensor>& param_out, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool decoupled_weight_decay, bool maximize, double grad_scale,
               const std::optional<at::Tensor>& exp_avg_scale, const std::optional<at::Tensor>& exp_avg_sq_scale,
               const std::optional<at::Tensor>& max_exp_avg_sq_scale, const OutSet& out);

// adam_step over the flat buffers, reading the gradient of elements [offsets[i], offsets[i] + grads[i].numel())
// from grads[i] (contiguous, one dtype for all); elements outside every segment are not touched. Segments must be
// sorted and must not overlap.
void adam_step_segments(const std::string& isa, const at::Tensor& param, const std::vector<at::Tensor>& grads,
                        const std::vector<int64_t>& offsets, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                        const std::optional<at::Tensor>& max_exp_avg_sq, const std::optional<at::Tensor>& param_out,
                        int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                        bool decoupled_weight_decay, bool maximize, double grad_scale,
                        const std::optional<at::Tensor>& exp_avg_scale,
                        const std::optional<at::Tensor>& exp_avg_sq_scale,
                        const std::optional<at::Tensor>& max_exp_avg_sq_scale, const OutSet& out);

std::tuple<double, bool> grad_sq_norm(const std::string& isa, const at::Tensor& grad);

// grad_sq_norm over several tensors at once, as if they were one buffer.
std::tuple<double, bool> grad_sq_norm_segments(const std::string& isa, const std::vector<at::Tensor>& grads);

// Binds the threads of the calling thread's intra-op team (the one at::parallel_for runs the kernel on, of
// at::get_num_threads() threads) to one CPU each: team thread t >= 1 to cpus[(t - 1) % cpus.size()]; thread 0, the
// caller, is left as it is. Returns, per team thread, the CPU it is now bound to (-1: the caller, or a thread whose
// mask is not one CPU). Linux only.
std::vector<int64_t> pin_team(const std::vector<int64_t>& cpus);

}  // namespace zo

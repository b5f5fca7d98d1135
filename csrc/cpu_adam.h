// The ATen-facing side of the kernel: argument checks, ISA detection and choice, threading.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace zo {

// ISAs compiled into this build and supported by the running CPU, best first ("scalar" always last).
std::vector<std::string> available_isas();

void adam_step(const std::string& isa, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
               const std::optional<at::Tensor>& param_out, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool decoupled_weight_decay, bool maximize, double grad_scale);

std::tuple<double, bool> grad_sq_norm(const std::string& isa, const at::Tensor& grad);

}  // namespace zo

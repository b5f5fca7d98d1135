// The Python module: one def per entry point. Each releases the GIL, so a worker thread can run the CPU step
// while Python and the GPU go on.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

// torch's pybind11 casters (at::Tensor to and from torch.Tensor) without <torch/extension.h>: 22 s to compile
// instead of 58 s.
#include <torch/csrc/utils/pybind.h>

#include "cpu_adam.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero_offload native CPU-Adam kernels";
  m.def("available_isas", &zo::available_isas,
        "ISAs compiled into this build that the running CPU supports, best first.");
  m.def("adam_step", &zo::adam_step, py::call_guard<py::gil_scoped_release>(),
        "One fused Adam/AdamW update, in place or into out (see zero_offload.functional.cpu_adam_ for the arguments).",
        py::arg("isa"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("max_exp_avg_sq"), py::arg("param_out"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled_weight_decay"),
        py::arg("maximize"), py::arg("grad_scale"), py::arg("exp_avg_scale") = py::none(),
        py::arg("exp_avg_sq_scale") = py::none(), py::arg("max_exp_avg_sq_scale") = py::none(),
        py::arg("out") = py::none());
  m.def("grad_sq_norm", &zo::grad_sq_norm, py::call_guard<py::gil_scoped_release>(),
        "(sum of squares as float64, whether any element is inf/nan) of a contiguous CPU gradient buffer.",
        py::arg("isa"), py::arg("grad"));
  m.def("adam_step_segments", &zo::adam_step_segments, py::call_guard<py::gil_scoped_release>(),
        "adam_step on flat buffers reading each segment's gradient from its own tensor (see "
        "zero_offload.functional._cpu_adam_segments_); elements outside the segments are not touched.",
        py::arg("isa"), py::arg("param"), py::arg("grads"), py::arg("offsets"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("max_exp_avg_sq"), py::arg("param_out"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("decoupled_weight_decay"), py::arg("maximize"), py::arg("grad_scale"),
        py::arg("exp_avg_scale") = py::none(), py::arg("exp_avg_sq_scale") = py::none(),
        py::arg("max_exp_avg_sq_scale") = py::none(), py::arg("out") = py::none());
  m.def("grad_sq_norm_segments", &zo::grad_sq_norm_segments, py::call_guard<py::gil_scoped_release>(),
        "(sum of squares as float64, whether any element is inf/nan) over a list of contiguous CPU gradients.",
        py::arg("isa"), py::arg("grads"));
  m.def("pin_team", &zo::pin_team, py::call_guard<py::gil_scoped_release>(),
        "Bind the calling thread's intra-op team threads 1.. to the given CPUs, one each; returns each team "
        "thread's CPU (-1: the caller, left as it is).",
        py::arg("cpus"));
}

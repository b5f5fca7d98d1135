"""Bad input to the functional API: a clear error naming the argument, and no tensor written."""

import pytest
import torch

from zero_offload import _build, functional

N = 33


def _buffers():
    gen = torch.Generator().manual_seed(0)
    return dict(param=torch.randn(N, generator=gen), grad=torch.randn(N, generator=gen),
                exp_avg=torch.rand(N, generator=gen), exp_avg_sq=torch.rand(N, generator=gen))


CASES = [
    ("non-contiguous grad", dict(grad=torch.randn(N * 2)[::2]), {}, "grad must be contiguous"),
    ("non-contiguous param", dict(param=torch.randn(N * 2)[::2]), {}, "param must be contiguous"),
    ("numel mismatch", dict(exp_avg=torch.zeros(N + 1)), {}, "exp_avg has 34 elements but param has 33"),
    ("float64 grad", dict(grad=torch.randn(N, dtype=torch.float64)), {}, "grad has unsupported dtype"),
    ("bf16 master", dict(param=torch.randn(N).bfloat16()), {}, "param has unsupported dtype"),
    ("fp16 moments", dict(exp_avg=torch.zeros(N).half(), exp_avg_sq=torch.zeros(N).half()), {},
     "exp_avg has unsupported dtype"),
    ("mixed moment dtypes", dict(exp_avg_sq=torch.zeros(N).bfloat16()), {}, "exp_avg_sq has unsupported dtype"),
    ("int8 param_out", {}, dict(param_out=torch.zeros(N, dtype=torch.int8)), "param_out has unsupported dtype"),
    ("non-CPU grad", dict(grad=torch.empty(N, device="meta")), {}, "grad must be on the CPU"),
    ("sparse grad", dict(grad=torch.randn(N).to_sparse()), {}, "grad must be a dense tensor"),
    ("not a tensor", dict(grad=[0.0] * N), {}, "grad must be a torch.Tensor"),
    ("negative lr", {}, dict(lr=-1e-3), "Invalid learning rate: -0.001"),
    ("nan lr", {}, dict(lr=float("nan")), "Invalid learning rate: nan"),
    ("step zero", {}, dict(step=0), "Invalid step: 0"),
    ("fractional step", {}, dict(step=1.5), "Invalid step: 1.5"),
    ("beta1 >= 1", {}, dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0"),
    ("beta2 < 0", {}, dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
    ("negative eps", {}, dict(eps=-1.0), "Invalid epsilon value"),
    ("negative weight decay", {}, dict(weight_decay=-0.1), "Invalid weight_decay value"),
    ("infinite grad_scale", {}, dict(grad_scale=float("inf")), "Invalid grad_scale"),
    ("amsgrad without buffer", {}, dict(amsgrad=True), "amsgrad=True needs max_exp_avg_sq"),
    ("buffer without amsgrad", {}, dict(max_exp_avg_sq=torch.zeros(N)), "amsgrad=False"),
]


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("name,tensors,kwargs,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_writes_nothing(monkeypatch, path, name, tensors, kwargs, message):
    if path == "torch":
        monkeypatch.setenv("ZERO_OFFLOAD_SIMD", "torch")
    elif not _build.native_isas():
        pytest.skip("native kernel unavailable")
    bufs = _buffers()
    bufs.update(tensors)
    before = {k: t.clone() for k, t in bufs.items()
              if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided}
    kw = dict(step=1, lr=1e-3)
    kw.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        functional.cpu_adam_(bufs["param"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"], **kw)
    for k, t in before.items():
        assert torch.equal(bufs[k], t), f"{k} was written by a rejected call"


def test_invalid_simd_choice(monkeypatch):
    monkeypatch.setenv("ZERO_OFFLOAD_SIMD", "sse9")
    with pytest.raises(ValueError, match="Invalid ZERO_OFFLOAD_SIMD='sse9'"):
        functional.resolve_path()


def test_forced_isa_this_cpu_lacks_is_an_error_not_a_fallback(monkeypatch):
    missing = [isa for isa in ("avx512", "avx2", "neon") if isa not in _build.native_isas()]
    if not missing or not _build.native_isas():
        pytest.skip("every ISA is available here")
    monkeypatch.setenv("ZERO_OFFLOAD_SIMD", missing[0])
    with pytest.raises(RuntimeError, match=f"ZERO_OFFLOAD_SIMD={missing[0]}"):
        functional.resolve_path()


def test_native_entry_point_checks_on_its_own():
    """The C++ boundary re-checks what Python validated, so a direct call cannot corrupt memory."""
    module = _build.load_native()
    if module is None:
        pytest.skip("native kernel unavailable")
    b = _buffers()
    with pytest.raises(RuntimeError, match="exp_avg has 34 elements"):
        module.adam_step(_build.native_isas()[-1], b["param"], b["grad"], torch.zeros(N + 1), b["exp_avg_sq"],
                         None, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, 1.0)

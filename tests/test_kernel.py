"""CPU-Adam kernel (every path this host can run) against torch.optim.AdamW / Adam (foreach=False) and, for bf16
moments, against the pure-torch reference; params and state checked every step at default fp32 tolerance."""

import itertools

import pytest
import torch

from zero_offload import _build, _reference, _torch_fused, functional

SIZES = [1, 7, 15, 16, 17, 4097, 278011]
PATHS = ["avx512", "avx2", "neon", "scalar", "torch-fused", "torch"]
STEPS = 30


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "torch-fused" and not _torch_fused.AVAILABLE:
        pytest.skip(f"torch {torch.__version__} has no fused CPU Adam")
    elif request.param not in ("torch", "torch-fused") and request.param not in _build.native_isas():
        pytest.skip(f"{request.param} is not available on this CPU/build")
    monkeypatch.setenv("ZERO_OFFLOAD_SIMD", request.param)
    return request.param


def _run_against_torch(n, *, grad_dtype=torch.float32, out_dtype=None, decoupled=True, amsgrad=False,
                       maximize=False, grad_scale=1.0, weight_decay=0.1, lr=1e-2, betas=(0.9, 0.999), seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=gen)
    ref = init.clone().requires_grad_(True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=lr, betas=betas, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
              foreach=False)
    param, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    vmax = torch.zeros(n) if amsgrad else None
    out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
    for step in range(1, STEPS + 1):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        # The reference sees exactly what the kernel computes from: the upcast (exact) gradient times the scale.
        ref.grad = grad.float() * grad_scale if grad_scale != 1.0 else grad.float()
        opt.step()
        functional.cpu_adam_(param, grad, m, v, step=step, lr=lr, betas=betas, weight_decay=weight_decay,
                             decoupled_weight_decay=decoupled, amsgrad=amsgrad, max_exp_avg_sq=vmax,
                             maximize=maximize, grad_scale=grad_scale, param_out=out)
        state = opt.state[ref]
        torch.testing.assert_close(param, ref.detach(), msg=lambda s: f"param at step {step}: {s}")
        torch.testing.assert_close(m, state["exp_avg"], msg=lambda s: f"exp_avg at step {step}: {s}")
        torch.testing.assert_close(v, state["exp_avg_sq"], msg=lambda s: f"exp_avg_sq at step {step}: {s}")
        if amsgrad:
            torch.testing.assert_close(vmax, state["max_exp_avg_sq"])
        if out is not None:
            # The low-precision copy must be the master rounded once, nearest-even: bit-equal to torch's cast.
            assert torch.equal(out, param.to(out_dtype)), f"param_out at step {step}"


@pytest.mark.parametrize("n", SIZES)
def test_adamw_matches_torch_on_tail_sizes(path, n):
    _run_against_torch(n)


@pytest.mark.parametrize("decoupled,amsgrad,maximize,grad_scale",
                         list(itertools.product([True, False], [False, True], [False, True], [1.0, 0.37])))
@pytest.mark.parametrize("n", [17, 4097])
def test_modes_match_torch(path, n, decoupled, amsgrad, maximize, grad_scale):
    _run_against_torch(n, decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale)


@pytest.mark.parametrize("grad_dtype,out_dtype", list(itertools.product(
    [torch.float32, torch.bfloat16, torch.float16], [None, torch.float32, torch.bfloat16, torch.float16])))
def test_grad_and_output_dtypes_match_torch(path, grad_dtype, out_dtype):
    _run_against_torch(4097, grad_dtype=grad_dtype, out_dtype=out_dtype)


@pytest.mark.parametrize("n", [15, 4097])
def test_large_beta1_uses_the_other_lerp_form(path, n):
    # 1 - beta1 >= 0.5 takes torch's second lerp formula; both must agree with it.
    _run_against_torch(n, betas=(0.3, 0.9))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("n", [7, 17, 4097])
def test_bf16_moments_match_reference(path, n, grad_dtype, amsgrad):
    """bf16 moments have no torch.optim counterpart: the oracle is our pure-torch reference, which keeps the
    moments in bf16 between steps and computes each update in fp32, as the kernel does."""
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(n, generator=gen)
    bufs = {k: [init.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16),
                torch.zeros(n, dtype=torch.bfloat16) if amsgrad else None, torch.empty(n, dtype=torch.bfloat16)]
            for k in ("ours", "ref")}
    for step in range(1, STEPS + 1):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        kw = dict(step=step, lr=1e-2, weight_decay=0.1, eps=1e-8)
        p, m, v, vmax, out = bufs["ours"]
        functional.cpu_adam_(p, grad, m, v, amsgrad=amsgrad, max_exp_avg_sq=vmax, param_out=out, **kw)
        p, m, v, vmax, out = bufs["ref"]
        _reference.adam_(p, grad, m, v, beta1=0.9, beta2=0.999, decoupled_weight_decay=True, max_exp_avg_sq=vmax,
                         maximize=False, grad_scale=1.0, param_out=out, **kw)
        ours, ref = bufs["ours"], bufs["ref"]
        # One bf16 ulp of a moment (see below) moves an update by up to lr * 2^-7, and persists, decaying by beta1
        # per step: its whole effect on the param is at most lr * 2^-7 / (1 - beta1).
        torch.testing.assert_close(ours[0], ref[0], atol=1e-2 * 2**-7 / (1 - 0.9), rtol=1.3e-6,
                                   msg=lambda s: f"param at step {step}: {s}")
        for name, a, b in zip(("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), ours[1:4], ref[1:4]):
            if a is not None:
                # Where the fp32 value lands near a bf16 rounding boundary, a few-ulp fp32 difference (FMA or not)
                # becomes one bf16 ulp, which then decays with beta while the value itself may shrink through zero:
                # the bound is one bf16 ulp (2^-7 relative at most) of the tensor's largest element.
                atol = 2**-7 * float(b.float().abs().max())
                torch.testing.assert_close(a, b, rtol=2**-7, atol=atol, msg=lambda s: f"{name} at step {step}: {s}")
        assert torch.equal(ours[4], ours[0].bfloat16()), f"param_out is not the master rounded, step {step}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_param_out_rounding_is_torchs_on_special_values(path, dtype):
    """With lr=0 the master is unchanged, so param_out is a pure conversion: nearest-even, ties, subnormals,
    overflow to inf, infinities and NaN must all match torch's own cast."""
    f32 = torch.float32
    specials = torch.tensor([0.0, -0.0, 1.0, -2.5, 1.00390625, 1.01171875, 1.0 + 2**-9, 1.0 + 3 * 2**-9,
                             65504.0, 65519.0, 65520.0, 1e5, 3e38, 6e-8, 3e-8, 2.9e-8, 1e-40, -1e-40,
                             float("inf"), float("-inf"), float("nan")], dtype=f32)
    gen = torch.Generator().manual_seed(2)
    values = torch.cat([specials, torch.randn(4096, generator=gen) * 1e3, torch.rand(777, generator=gen) * 1e-6])
    n = values.numel()
    param, out = values.clone(), torch.empty(n, dtype=dtype)
    functional.cpu_adam_(param, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, param_out=out)
    expected = values.to(dtype)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16 if dtype != f32 else torch.int32),
                       expected[~nan].view(torch.int16 if dtype != f32 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_grad_sq_norm(path, n, dtype):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    total, nonfinite = functional.grad_sq_norm(g)
    expected = g.double().square().sum().item()
    # Float partial sums of at most 64 terms per lane, combined in double: under 64 float ulps of relative error.
    assert total == pytest.approx(expected, rel=1e-5)
    assert nonfinite is False
    for bad in (float("inf"), float("-inf"), float("nan")):
        h = g.clone()
        h[-1] = bad  # the last element: the vector tail on every path
        assert functional.grad_sq_norm(h)[1] is True


def test_grad_sq_norm_reads_side_by_side_stretches_whole(path):
    # Four whole blocks or more are read four stretches at a time, in rounds of up to 256 blocks per stretch; the
    # blocks left over, a partial block and the tail one at a time. This size gives two full rounds at every
    # ISA's block (64 vectors), a short round and leftovers: an inf/nan anywhere is found, and the sum is whole.
    n = 2 * 4 * 256 * 1024 + 5 * 1024 + 77
    g = torch.randn(n, generator=torch.Generator().manual_seed(9))
    total, nonfinite = functional.grad_sq_norm(g)
    assert total == pytest.approx(g.double().square().sum().item(), rel=1e-5) and nonfinite is False
    for at in torch.linspace(0, n - 1, 61).long().tolist():
        h = g.clone()
        h[at] = float("nan") if at % 2 else float("inf")
        assert functional.grad_sq_norm(h)[1] is True, at
        assert functional.grad_sq_norm_segments([g[:100], h])[1] is True, at


def test_queued_updates_run_in_order_at_exit_even_when_the_body_raises(path):
    # Two updates of one buffer queued, then one of a second: nothing is written until the outermost context exits;
    # then the result is that of the same calls made at once, in order (two steps of AdamW on the first buffer).
    # A body that raises still runs what it queued before the error goes on.
    n = 4097
    gen = torch.Generator().manual_seed(5)
    inits, grads = [torch.randn(n, generator=gen) for _ in range(2)], [torch.randn(n, generator=gen) for _ in range(3)]

    def calls(bufs):
        for step, (b, g) in enumerate([(0, grads[0]), (0, grads[1]), (1, grads[2])]):
            param, m, v = bufs[b]
            functional.cpu_adam_segments_(param, [g[:7], g[7:]], [0, 7], m, v, step=1 + step - 2 * b, lr=1e-2,
                                          weight_decay=0.1)

    def fresh():
        return [(t.clone(), torch.zeros(n), torch.zeros(n)) for t in inits]

    at_once = fresh()
    calls(at_once)
    queued = fresh()
    with functional.queued_updates():
        with functional.queued_updates():  # nested: the outer one runs the queue
            calls(queued)
        native = path not in ("torch", "torch-fused")  # (the torch paths run at once)
        assert torch.equal(queued[0][0], inits[0]) is native and torch.equal(queued[1][0], inits[1]) is native
    for (p, m, v), (rp, rm, rv) in zip(queued, at_once):
        assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
    raised = fresh()
    with pytest.raises(KeyError, match="after the calls"):
        with functional.queued_updates():
            calls(raised)
            raise KeyError("after the calls")
    for (p, m, v), (rp, rm, rv) in zip(raised, at_once):
        assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)


def test_grad_sq_norm_overflow_is_not_nonfinite(path):
    g = torch.full((1000,), 1e30)  # finite values whose squares overflow fp32
    total, nonfinite = functional.grad_sq_norm(g)
    assert nonfinite is False
    # The native path sums in fp32 blocks (inf, as torch's fp32 norm would be); the reference sums in float64.
    assert total == float("inf") or total == pytest.approx(1e63, rel=1e-6)


THREAD_TEST_NUMEL = 3_000_017  # many blocks per thread, and a tail


def per_thread_count(run):
    """``run(init, grad)`` with 1 and then 2 threads, on the same fp32 parameter and bf16 gradient of
    :data:`THREAD_TEST_NUMEL` elements; the thread setting is restored after."""
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(THREAD_TEST_NUMEL, generator=gen)
    grad = torch.randn(THREAD_TEST_NUMEL, generator=gen).bfloat16()
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(run(init, grad))
        return results
    finally:
        torch.set_num_threads(before)


def test_thread_count_does_not_change_results(path):
    def run(init, grad):
        n = init.numel()
        p, m, v, out = init.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
        functional.cpu_adam_(p, grad, m, v, step=1, lr=1e-3, param_out=out)
        return p, m, v, out, functional.grad_sq_norm(grad)

    results = per_thread_count(run)
    for a, b in zip(results[0][:4], results[1][:4]):
        assert torch.equal(a, b)
    assert results[0][4][0] == pytest.approx(results[1][4][0], rel=1e-12)


def test_zero_elements_is_a_no_op(path):
    e = torch.empty(0)
    functional.cpu_adam_(e, e, e, e, step=1, lr=1e-3)
    assert functional.grad_sq_norm(e) == (0.0, False)


@pytest.mark.parametrize("offset", [0, 1, 5])
def test_param_out_at_any_alignment(path, offset):
    """Aligned outputs take streaming stores, unaligned ones plain stores: both must write the same values."""
    n = 70_001
    gen = torch.Generator().manual_seed(4)
    init, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        p, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.full((n + offset,), 7.0, dtype=out_dtype)[offset:]  # offset elements: 2 or 4 bytes each
        functional.cpu_adam_(p, grad, m, v, step=1, lr=1e-3, param_out=out)
        assert torch.equal(out, p.to(out_dtype))


def _segments(sizes, gap):
    """64-aligned offsets with ``gap`` untouched elements before each segment; returns (offsets, buffer length)."""
    offsets, cursor = [], 0
    for n in sizes:
        cursor += gap
        offsets.append(cursor)
        cursor += (n + 63) // 64 * 64
    return offsets, cursor + gap


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad,out_dtype", [(False, None), (True, torch.bfloat16)])
def test_segments_equal_cpu_adam_per_segment_and_leave_gaps_alone(path, grad_dtype, amsgrad, out_dtype):
    # 300_001 elements span several threads' shares of the flat range, so a segment is cut mid-way.
    sizes = [1, 7, 17, 4097, 300_001, 0, 64]
    offsets, n = _segments(sizes, gap=128)
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(k, generator=gen).to(grad_dtype) for k in sizes]
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, grad_scale=0.5)
    # Every buffer starts non-zero, so a write to a gap (even of what it held, updated) shows.
    init = [torch.rand(n, generator=gen) + 0.5 for _ in range(4)]
    out_init = torch.full((n,), 3.0, dtype=out_dtype) if out_dtype is not None else None
    seg = [t.clone() for t in init] + ([out_init.clone()] if out_dtype is not None else [])
    one = [t.clone() for t in init] + ([out_init.clone()] if out_dtype is not None else [])

    def bufs(b, sl=slice(None)):
        return dict(max_exp_avg_sq=b[3][sl] if amsgrad else None, param_out=b[4][sl] if out_dtype else None)

    for step in (1, 2, 3):
        functional.cpu_adam_segments_(seg[0], grads, offsets, seg[1], seg[2], step=step, **kw, **bufs(seg))
        for o, g in zip(offsets, grads):
            sl = slice(o, o + g.numel())
            functional.cpu_adam_(one[0][sl], g, one[1][sl], one[2][sl], step=step, **kw, **bufs(one, sl))
    for a, b in zip(seg, one):
        assert torch.equal(a, b)
    inside = torch.zeros(n, dtype=torch.bool)
    for o, k in zip(offsets, sizes):
        inside[o : o + k] = True
    for k, (a, before) in enumerate(zip(seg, init + ([out_init] if out_dtype is not None else []))):
        assert torch.equal(a[~inside], before[~inside])
        if k != 3 or amsgrad:  # buffer 3 is amsgrad's, unused without it
            assert not torch.equal(a[inside], before[inside])


def test_segments_are_validated(path):
    p, m, v = torch.zeros(256), torch.zeros(256), torch.zeros(256)
    g = torch.ones(64)
    with pytest.raises(ValueError, match="overlap"):
        functional.cpu_adam_segments_(p, [g, g], [0, 32], m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="overlap"):
        functional.cpu_adam_segments_(p, [g, g], [128, 0], m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="past the buffers"):
        functional.cpu_adam_segments_(p, [g], [224], m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="contiguous"):
        functional.cpu_adam_segments_(p, [torch.ones(8, 8).t()], [0], m, v, step=1, lr=1e-3)
    with pytest.raises(TypeError, match="one dtype"):
        functional.cpu_adam_segments_(p, [g, g.bfloat16()], [0, 64], m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        functional.cpu_adam_segments_(p, [g], [0], m, v, step=1, lr=-1.0)
    assert torch.equal(p, torch.zeros(256)) and torch.equal(m, torch.zeros(256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_sq_norm_segments(path, dtype):
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(k, generator=gen).to(dtype) for k in [1, 7, 0, 17, 4097, 300_001]]
    total, nonfinite = functional.grad_sq_norm_segments(grads)
    expected = sum(g.double().square().sum().item() for g in grads)
    assert total == pytest.approx(expected, rel=1e-5)
    assert nonfinite is False
    assert functional.grad_sq_norm_segments([]) == (0.0, False)
    for i in (0, 3, 5):
        bad = [g.clone() for g in grads]
        bad[i][-1] = float("nan")
        assert functional.grad_sq_norm_segments(bad)[1] is True


@pytest.mark.skipif(not _torch_fused.AVAILABLE, reason="torch < 2.4 has no fused CPU Adam")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37, 2.0 ** -14, 3.3e-5])
def test_torch_fused_scales_each_gradient_as_upcast_times_the_scale(grad_dtype, grad_scale):
    """What torch's fused kernel is handed (one multi-tensor multiply for the whole list): bit for bit each gradient
    upcast, times the scale (``g.float() * s``, as the native kernel rounds it), an inf kept; fp32 gradients with a
    scale of 1 are the given tensors themselves, and no given tensor is written."""
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=gen) * 100).to(grad_dtype) for n in (1, 7, 17, 4097)]
    grads[1][3] = float("inf")
    before = [g.clone() for g in grads]
    got = _torch_fused.scaled_fp32(grads, grad_scale)
    for g, b, s in zip(grads, before, got):
        assert s.dtype == torch.float32 and torch.equal(g, b)
        assert torch.equal(s.view(torch.int32), (b.float() * grad_scale).view(torch.int32))
        assert (s is g) == (grad_dtype == torch.float32 and grad_scale == 1.0)

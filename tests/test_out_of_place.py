"""The out-of-place CPU-Adam update (``out=``, a ping-pong between two buffer sets) on every path this host runs: bit-identical
to the in-place update for every dtype combination and mode, the inputs left untouched bit for bit, the segments
entry too, a ping-pong over many steps against torch.optim.AdamW, and a bad out-set refused with nothing written."""

import itertools

import pytest
import torch

from zero_offload import _build, functional

from test_kernel import _segments, path  # noqa: F401 (path: the kernel paths' fixture)

TAIL_SIZES = [1, 7, 15, 17, 4097]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STATE_DTYPES = [torch.float32, torch.bfloat16, torch.int8]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]
# (decoupled, amsgrad, maximize, grad_scale)
MODES = list(itertools.product([True, False], [False, True], [False, True], [1.0, 0.37]))


def _bits(t):
    """A tensor's bytes: equality of these is bit-equality, NaN payloads included."""
    return t.contiguous().view(-1).view(torch.uint8)


def assert_bits_equal(a, b, what):
    assert a.dtype == b.dtype and a.numel() == b.numel(), what
    assert torch.equal(_bits(a), _bits(b)), what


def make_state(n, state_dtype, amsgrad, gen):
    """The buffers of an update, by their out keys, from random non-trivial moments (8-bit: quantised)."""
    m, v = torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4
    bufs = {"param": torch.randn(n, generator=gen)}
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    values = dict(exp_avg=m, exp_avg_sq=v, max_exp_avg_sq=v * 1.5)
    for name in names:
        if state_dtype == torch.int8:
            codes = torch.empty(n, dtype=torch.int8 if name == "exp_avg" else torch.uint8)
            scale = torch.empty(functional.q8_scale_numel(n))
            functional.quantize_state_(codes, scale, values[name])
            bufs[name], bufs[name + "_scale"] = codes, scale
        else:
            bufs[name] = values[name].to(state_dtype)
    return bufs


def garbage_like(bufs):
    """Destinations pre-filled with a byte pattern no update writes, so an element left unwritten shows."""
    return {k: torch.full_like(t, 0).view(torch.uint8).fill_(0xA5).view(t.dtype) if t.numel() else t.clone()
            for k, t in bufs.items()}


def clone(bufs):
    return {k: t.clone() for k, t in bufs.items()}


def step(bufs, grad, n_step, mode, param_out, out=None, **extra):
    decoupled, amsgrad, maximize, grad_scale = mode
    kw = {k: t for k, t in bufs.items() if k != "param"}
    functional.cpu_adam_(bufs["param"], grad, step=n_step, lr=1e-2, weight_decay=0.1,
                         decoupled_weight_decay=decoupled, amsgrad=amsgrad, maximize=maximize,
                         grad_scale=grad_scale, param_out=param_out, out=out, **kw, **extra)


def check_ping_pong(n, grad_dtype, state_dtype, out_dtype, mode, seed=0, poison=False):
    """Three steps in place on one copy; on another, A -> B, B -> A, A -> B out of place: every step's result
    bit-equal, and the set read left as it was."""
    gen = torch.Generator().manual_seed(seed)
    a = make_state(n, state_dtype, mode[1], gen)
    ref, b = clone(a), garbage_like(a)
    for k in (1, 2, 3):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        if poison and k == 1:
            grad[::5] = float("nan")  # 8-bit state keeps these per element (poisoned) for the next steps
        po_ref = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
        po = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
        src, dst = (a, b) if k % 2 else (b, a)
        before = clone(src)
        step(ref, grad, k, mode, po_ref)
        step(src, grad, k, mode, po, out=dst)
        what = f"n={n} grad={grad_dtype} state={state_dtype} out={out_dtype} mode={mode} step {k}"
        for key in ref:
            assert_bits_equal(dst[key], ref[key], f"{key} (out of place) {what}")
            assert_bits_equal(src[key], before[key], f"{key} (the input, written) {what}")
        if po is not None:
            assert_bits_equal(po, po_ref, f"param_out {what}")


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_out_of_place_is_bit_identical_to_in_place(path, grad_dtype, state_dtype, out_dtype):
    for n, mode in itertools.product(TAIL_SIZES, MODES):
        check_ping_pong(n, grad_dtype, state_dtype, out_dtype, mode)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_out_of_place_on_a_large_buffer(path, state_dtype):
    # Several threads' blocks, a tail, every 8-bit block pass; one mode with everything on.
    check_ping_pong(278011, torch.bfloat16, state_dtype, torch.bfloat16, (True, True, True, 0.37))


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("shift", [0, 1, 3])
def test_out_of_place_at_any_alignment(path, state_dtype, shift):
    """Destinations on a 64-byte boundary take streaming stores, others plain ones (here the master's destination
    is shifted, the moments' too when shift is odd): both must write the in-place result."""
    n, gen = 70_001, torch.Generator().manual_seed(8)
    src = make_state(n, state_dtype, True, gen)
    ref, before, grad = clone(src), clone(src), torch.randn(n, generator=gen).bfloat16()
    out = {}
    for key, t in garbage_like(src).items():
        moved = key == "param" or (shift % 2 and not key.endswith("_scale"))
        out[key] = torch.empty(t.numel() + shift, dtype=t.dtype)[shift:].copy_(t) if moved else t
    mode = (True, True, False, 0.37)
    step(ref, grad, 2, mode, None)
    step(src, grad, 2, mode, None, out=out)
    for key in src:
        assert_bits_equal(out[key], ref[key], key)
        assert_bits_equal(src[key], before[key], f"{key} (the input)")


@pytest.mark.parametrize("n", [17, 4097])
def test_out_of_place_keeps_poisoned_8bit_elements_as_in_place(path, n):
    # A poisoned block's masters take a path of their own (made NaN before the update): out of place it must
    # write them to the destination and leave the source alone.
    check_ping_pong(n, torch.float32, torch.int8, torch.bfloat16, (True, True, False, 1.0), poison=True)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("n", [1, 7, 15, 17, 4097, 278011])
def test_ping_pong_matches_torch_adamw(path, n, amsgrad):
    """30 steps alternating between two buffer sets against torch.optim.AdamW(foreach=False), default fp32
    tolerance, params and state every step."""
    gen = torch.Generator().manual_seed(7)
    init = torch.randn(n, generator=gen)
    ref = init.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, foreach=False)
    names = ["param", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    sets = [{k: init.clone() if k == "param" else torch.zeros(n) for k in names},
            {k: torch.full((n,), float("nan")) for k in names}]
    for k in range(1, 31):
        grad = torch.randn(n, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        src, dst = sets[(k - 1) % 2], sets[k % 2]
        step(src, grad, k, (True, amsgrad, False, 1.0), None, out=dst)
        state = opt.state[ref]
        torch.testing.assert_close(dst["param"], ref.detach(), msg=lambda s: f"param at step {k}: {s}")
        for name in names[1:]:
            torch.testing.assert_close(dst[name], state[name], msg=lambda s: f"{name} at step {k}: {s}")


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("amsgrad,out_dtype", [(False, None), (True, torch.bfloat16)])
def test_segments_out_of_place(path, state_dtype, amsgrad, out_dtype):
    """Segments out of place: each segment (and its scale blocks) bit-equal to the in-place segments call, the
    inputs untouched, and the destinations outside the segments left as they were."""
    sizes = [1, 7, 17, 4097, 300_001, 0, 64]
    offsets, n = _segments(sizes, gap=128)
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(k, generator=gen).bfloat16() for k in sizes]
    src = make_state(n, state_dtype, amsgrad, gen)
    ref, before, dst = clone(src), clone(src), garbage_like(src)
    dst_before = clone(dst)
    po = torch.zeros(n, dtype=out_dtype) if out_dtype is not None else None
    po_ref = po.clone() if po is not None else None
    kw = dict(step=3, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, grad_scale=0.5)

    def call(bufs, param_out, out=None):
        state = {k: t for k, t in bufs.items() if k != "param"}
        functional.cpu_adam_segments_(bufs["param"], grads, offsets, **state, **kw, param_out=param_out, out=out)

    call(ref, po_ref)
    call(src, po, out=dst)
    inside = torch.zeros(n, dtype=torch.bool)
    blocks = torch.zeros(functional.q8_scale_numel(n), dtype=torch.bool)
    for o, k in zip(offsets, sizes):
        inside[o : o + k] = True
        blocks[o // 64 : functional.q8_scale_numel(o + k)] = k > 0
    for key in src:
        assert_bits_equal(src[key], before[key], f"{key}: the input was written")
        mask = blocks if key.endswith("_scale") else inside
        assert_bits_equal(dst[key][mask], ref[key][mask], f"{key}: segments")
        assert_bits_equal(dst[key][~mask], dst_before[key][~mask], f"{key}: outside the segments")
    if po is not None:
        assert_bits_equal(po, po_ref, "param_out")


def test_partly_in_place_out_set(path):
    """A destination may be its own source: that buffer is updated in place, the others out of place."""
    n, gen = 4097, torch.Generator().manual_seed(9)
    src = make_state(n, torch.float32, False, gen)
    ref, grad = clone(src), torch.randn(n, generator=gen)
    out = dict(garbage_like(src), exp_avg=src["exp_avg"])
    before_param = src["param"].clone()
    step(ref, grad, 1, MODES[0], None)
    step(src, grad, 1, MODES[0], None, out=out)
    for key in ref:
        assert_bits_equal(out[key], ref[key], key)
    assert_bits_equal(src["param"], before_param, "param (the input)")


def test_bad_out_is_refused_with_nothing_written(path):
    n, gen = 4097, torch.Generator().manual_seed(11)
    # param lives in a storage one element longer, so that a destination can overlap it partly (shifted by one).
    storage = torch.zeros(n + 1)
    src = make_state(n, torch.float32, False, gen)
    src["param"] = storage[:n].copy_(src["param"])
    grad = torch.randn(n, generator=gen)
    good, wide = garbage_like(src), torch.zeros(2 * n)
    cases = [
        (dict(good, param=torch.zeros(n + 1)), "out\\['param'\\] must be torch.float32 with"),
        (dict(good, exp_avg=torch.zeros(n, dtype=torch.bfloat16)), "out\\['exp_avg'\\] must be"),
        (dict(good, exp_avg_sq=torch.zeros(n, 2)[:, 0]), "out\\['exp_avg_sq'\\] must be a dense, contiguous"),
        ({k: t for k, t in good.items() if k != "exp_avg_sq"}, "out lacks 'exp_avg_sq'"),
        (dict(good, max_exp_avg_sq=torch.zeros(n)), "out\\['max_exp_avg_sq'\\] is not a buffer"),
        (dict(good, param=storage[1:]), "out\\['param'\\] overlaps param"),  # partly its own source
        (dict(good, exp_avg=src["exp_avg_sq"]), "out\\['exp_avg'\\] overlaps exp_avg_sq"),
        (dict(good, exp_avg_sq=grad), "overlaps grad"),
        (dict(good, exp_avg=wide[:n], exp_avg_sq=wide[n - 1 : 2 * n - 1]), "overlaps out\\['exp_avg'\\]"),
        ([good["param"]], "out must be a dict"),
    ]
    for out, message in cases:
        before = clone(src)
        outs_before = clone(out) if isinstance(out, dict) else None
        with pytest.raises((ValueError, TypeError), match=message):
            step(src, grad, 1, MODES[0], None, out=out)
        for key in src:
            assert_bits_equal(src[key], before[key], f"{key} written by a refused call ({message})")
        for key in outs_before or ():
            assert_bits_equal(out[key], outs_before[key], f"out[{key!r}] written by a refused call ({message})")


def test_bad_out_for_8bit_state_names_the_scale(path):
    n, gen = 200, torch.Generator().manual_seed(12)
    src = make_state(n, torch.int8, False, gen)
    out = dict(garbage_like(src), exp_avg_sq_scale=torch.zeros(functional.q8_scale_numel(n) + 1))
    before = clone(src)
    with pytest.raises(ValueError, match="out\\['exp_avg_sq_scale'\\] must be torch.float32 with 4 elements"):
        step(src, torch.randn(n), 1, MODES[0], None, out=out)
    out = dict(garbage_like(src), exp_avg_scale=src["exp_avg_sq_scale"])
    with pytest.raises(ValueError, match="out\\['exp_avg_scale'\\] overlaps exp_avg_sq_scale"):
        step(src, torch.randn(n), 1, MODES[0], None, out=out)
    for key in src:
        assert_bits_equal(src[key], before[key], key)


def test_segments_refuse_an_out_overlapping_a_gradient(path):
    n = 256
    src = make_state(n, torch.float32, False, torch.Generator().manual_seed(13))
    out = garbage_like(src)
    grads = [out["exp_avg"][64:128]]  # a gradient living in a destination
    before, out_before = clone(src), clone(out)
    with pytest.raises((ValueError, RuntimeError), match="overlaps"):
        functional.cpu_adam_segments_(src["param"], grads, [0], src["exp_avg"], src["exp_avg_sq"], step=1, lr=1e-3,
                                      out=out)
    for key in src:
        assert_bits_equal(src[key], before[key], key)
        assert_bits_equal(out[key], out_before[key], f"out[{key!r}]")


def _native_or_skip():
    native = _build.load_native()
    if native is None:
        pytest.skip(f"native kernel unavailable: {_build.status().detail}")
    return native


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "neon"])
def test_native_entry_refuses_bad_out_on_its_own(isa):
    """The C++ boundary checks the out-set itself (Python checks first; this calls the extension directly)."""
    native = _native_or_skip()
    if isa not in _build.native_isas():
        pytest.skip(f"{isa} not available")
    n = 1000
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    base = [p, g, m, v, None, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, 1.0]
    good = dict(param=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))
    storage = torch.zeros(n + 1)
    storage[:n] = m
    bad = [
        (dict(good, exp_avg=storage[1:]), [p, g, storage[:n], v], "overlaps exp_avg"),
        (dict(good, param=v), None, "overlaps exp_avg_sq"),
        (dict(good, exp_avg_sq=g), None, "overlaps grad"),
        (dict(good, param=torch.zeros(n + 1)), None, "elements"),
        (dict(good, param=torch.zeros(n, dtype=torch.float64)), None, "Double"),
        (dict(good, param=torch.zeros(n, 2)[:, 0]), None, "contiguous"),
        ({k: t for k, t in good.items() if k != "exp_avg"}, None, "lacks 'exp_avg'"),
        (dict(good, max_exp_avg_sq=torch.zeros(n)), None, "not a buffer this update writes"),
    ]
    for out, head, message in bad:
        args = (head or base[:4]) + base[4:]
        before = [t.clone() for t in args[:4]] + [t.clone() for t in out.values()]
        with pytest.raises(RuntimeError, match=message):
            native.adam_step(isa, *args, out=out)
        for a, b in zip(list(args[:4]) + list(out.values()), before):
            assert_bits_equal(a, b, f"written by a refused call ({message})")
    # and the good set works, bit-equal to in place
    ref = [t.clone() for t in (p, g, m, v)]
    native.adam_step(isa, *ref, *base[4:])
    native.adam_step(isa, *base, out=good)
    for key, r in zip(("param", "exp_avg", "exp_avg_sq"), (ref[0], ref[2], ref[3])):
        assert_bits_equal(good[key], r, key)


def test_out_tensors_of_another_shape(path):
    """Destinations need the elements, not the shape: 2-D ones work for both entries."""
    n, gen = 4096, torch.Generator().manual_seed(15)
    src = make_state(n, torch.int8, False, gen)
    grads, offsets = [torch.randn(100, generator=gen), torch.randn(1000, generator=gen)], [0, 128]
    ref = clone(src)
    out = {k: t.view(-1, 4) if k.endswith("_scale") else t.view(64, -1) for k, t in garbage_like(src).items()}
    state = {k: t for k, t in ref.items() if k != "param"}
    functional.cpu_adam_segments_(ref["param"], grads, offsets, **state, step=1, lr=1e-3)
    state = {k: t for k, t in src.items() if k != "param"}
    functional.cpu_adam_segments_(src["param"], grads, offsets, **state, step=1, lr=1e-3, out=out)
    live = torch.cat([torch.arange(100), torch.arange(128, 1128)])  # the segments' elements
    for key in src:
        sel = torch.arange(18) if key.endswith("_scale") else live  # blocks 0-1 and 2-17
        assert_bits_equal(out[key].reshape(-1)[sel], ref[key][sel], key)


def test_2d_buffers_with_param_out(path):
    """cpu_adam_ on 2-D buffers with a 2-D param_out, into flat destinations: the in-place result."""
    n, gen = 4096, torch.Generator().manual_seed(16)
    src = {k: t.view(64, 64) for k, t in make_state(n, torch.float32, False, gen).items()}
    ref, grad = clone(src), torch.randn(64, 64, generator=gen)
    po, po_ref = torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(64, 64, dtype=torch.bfloat16)
    out = {k: t.reshape(-1) for k, t in garbage_like(src).items()}
    step(ref, grad, 1, MODES[0], po_ref)
    step(src, grad, 1, MODES[0], po, out=out)
    for key in src:
        assert_bits_equal(out[key], ref[key], key)
    assert_bits_equal(po, po_ref, "param_out")

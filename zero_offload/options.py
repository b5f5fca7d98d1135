"""What a user may ask of an :class:`~zero_offload.OffloadOptimizer`, validated once: the offload options as one
frozen :class:`Options`, and the validators of hyperparameters, parameter groups, parameters and step counts that
the constructor, ``add_param_group``, ``step``, both state-dict loaders and :mod:`zero_offload.functional` share,
so each rule and its message exists once.

Messages of the checks AdamW also makes are AdamW's own, so code matching on them keeps working.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
from numbers import Real
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from zero_offload import fsdp2
from zero_offload.functional import check_hparams

__all__ = ["DEFAULT_BUCKET_NUMEL", "DTYPE_NAMES", "NONFINITE_POLICIES", "OFFLOAD_OPTIONS", "STATE_DTYPES",
           "REMOVED_OPTIONS", "SUPPORTED_DTYPES", "Options", "option_docs", "agreed_settings", "check_group",
           "check_impl_flags", "check_option_names", "check_params", "check_removed", "check_state_dtype", "check_step",
           "delayed_setting", "dtypes_by_name", "gpu_params", "planned_placement",
           "prefixed", "refuse_offload_options", "world_without_group"]

NONFINITE_POLICIES = ("raise", "skip", "ignore")
# 32 Mi elements (128 MiB of fp32 per buffer): big enough that a kernel call's fixed cost is noise, small enough
# that with the model on a GPU the copies of one bucket overlap the CPU update of the previous one.
DEFAULT_BUCKET_NUMEL = 1 << 25
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The state's storage (zero_offload.state.codecs): fp32 (exactly AdamW), bf16, or int8 meaning 8-bit block-wise
# (int8 codes for a signed buffer, uint8 for a non-negative one, a float32 scale per 64 elements).
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
# The dtypes' short names, as the command-line tools and benchmarks spell them (int8: the 8-bit block-wise state).
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8"}


def dtypes_by_name(dtypes: Sequence[torch.dtype]) -> Dict[str, torch.dtype]:
    """``dtypes`` keyed by their :data:`DTYPE_NAMES`, e.g. for a command-line choice."""
    return {DTYPE_NAMES[d]: d for d in dtypes}


# Bias corrections are exact in double far beyond this; AdamW's own step counts are float32, whose integers are
# exact up to 2**24.
MAX_STEP = 2**24


@contextlib.contextmanager
def prefixed(where: str) -> Iterator[None]:
    """A ``ValueError`` raised inside, its message prefixed with ``where`` (what was checked: a loaded group, an
    ``opt.state`` entry); as it is where ``where`` is empty."""
    try:
        yield
    except ValueError as exc:
        if not where:
            raise
        raise ValueError(f"{where}: {exc}") from None


def check_group(group: Dict[str, Any]) -> None:
    """Validate a parameter group's hyperparameters (the defaults, a group being added, a loaded group): AdamW's
    checks, and the two flags this optimizer cannot honour."""
    check_impl_flags(group)
    check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    betas = group["betas"]
    if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, torch.Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    if group.get("capturable"):
        raise ValueError("OffloadOptimizer does not support capturable=True: step() synchronises with the host "
                         "to run the CPU kernel, which CUDA-graph capture forbids")


def refuse_offload_options(group: Dict[str, Any], defaults: Dict[str, Any]) -> None:
    """A param group's key that is an offload option (``placement``, ``gpu_fraction``, ``bucket_numel``...) and
    not a hyperparameter of the rule's class: every group takes the constructor's option, so the group's value
    would be ignored without a word (torch keeps unknown keys in a group)."""
    given = [k for k in group if k in OFFLOAD_OPTIONS and k not in defaults]
    if given:
        name = given[0]
        raise ValueError(f"{name}={group[name]!r} in a param group: {name} is an option of the whole optimizer, "
                         f"taken by every group (OffloadOptimizer(..., {name}=...)); a group's own value would be "
                         "ignored")


def check_impl_flags(group: Dict[str, Any]) -> None:
    """The ``foreach``/``fused``/``differentiable`` combinations ``torch.optim.AdamW`` refuses, refused here with its
    errors and in its order although this optimizer ignores ``foreach`` and ``fused`` (code written for AdamW, and
    PyTorch's own optimizer tests, rely on them); and ``differentiable``, which cannot work here."""
    foreach, fused = group.get("foreach"), group.get("fused")
    if foreach and not group.get("capturable"):
        if isinstance(group["lr"], torch.Tensor):
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        for i, beta in enumerate(group["betas"] if isinstance(group["betas"], (tuple, list)) else ()):
            if isinstance(beta, torch.Tensor):
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
    if fused and group.get("differentiable"):
        raise RuntimeError("`fused` does not support `differentiable`")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if group.get("differentiable"):
        # (AdamW accepts the flag but then fails at step() on any leaf parameter that requires grad, with a
        # RuntimeError; the non-leaf tensors it can differentiate through are refused here anyway.)
        raise RuntimeError("OffloadOptimizer does not support differentiable=True: the update runs in a host kernel "
                           "outside autograd")


def check_state_dtype(state_dtype: Any) -> None:
    """``state_dtype`` as the constructor and ``estimate_host_memory`` take it: one of :data:`STATE_DTYPES`
    (torch dtypes; names such as ``"int8"`` are refused, as torch's own ``dtype=`` arguments refuse them)."""
    if not any(state_dtype is d for d in STATE_DTYPES):
        raise ValueError(f"Invalid state_dtype: {state_dtype!r} (expected torch.float32, torch.bfloat16, or "
                         "torch.int8 for 8-bit block-wise moments)")


def check_step(step: Any, where: str) -> float:
    """A loaded step count: a whole number in ``[0, 2**24]``, plain or a one-element tensor. Returns it as a
    float (``ValueError`` naming ``where`` otherwise)."""
    value = step
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise ValueError(f"{where}: step is on the meta device: it has no value to load")
        if value.numel() != 1:
            raise ValueError(f"{where}: step must hold one number, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0 \
            or value != int(value) or value > MAX_STEP:
        raise ValueError(f"{where}: invalid step {step!r} (a whole number >= 0)")
    return float(value)


def check_params(params: Sequence[Any], fsdp: bool = False) -> None:
    """What the buckets can hold: dense leaf tensors of a supported dtype on CPU or CUDA, each once; DTensors only
    in an optimizer over FSDP2's parameters (``fsdp``: the constructor found them; :mod:`zero_offload.fsdp2`
    checks their placements)."""
    seen = set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError("optimizer can only optimize Tensors, but one of the params is " + torch.typename(p))
        if fsdp2.is_dtensor(p) and not fsdp:
            raise TypeError(
                f"OffloadOptimizer: a DTensor parameter (shape {tuple(p.shape)}, placements {tuple(p.placements)}) "
                "in a param group added to an optimizer built over plain parameters: an optimizer takes FSDP2's "
                "sharded parameters (fully_shard) or plain ones, not both")
        if not p.is_leaf:
            raise ValueError("can't optimize a non-leaf Tensor")
        if p.is_complex():
            raise ValueError(f"OffloadOptimizer does not support complex parameters ({p.dtype}, shape "
                             f"{tuple(p.shape)}): keep them as real pairs in the model (torch.view_as_real)")
        if p.dtype == torch.float64:
            raise ValueError("OffloadOptimizer does not support float64 parameters: its masters and moments are "
                             "float32, so the update would silently lose precision. Keep a float64 model on "
                             "torch.optim.AdamW (fused=True is fast on the CPU), or cast it to float32 first")
        if p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"OffloadOptimizer supports float32, bfloat16 and float16 parameters, not {p.dtype}")
        if p.layout != torch.strided:
            raise ValueError(f"OffloadOptimizer supports dense parameters only, not {p.layout}")
        if p.is_meta:
            raise ValueError("OffloadOptimizer does not support parameters on the meta device: they have no values "
                             "to keep in host memory. Materialise the model (to_empty() and initialise it) first")
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"OffloadOptimizer supports parameters on cpu or cuda, not {p.device}")
        if id(p) in seen:  # AdamW warns and updates it twice; a parameter has one slot in the buffers
            raise ValueError(f"a parameter of shape {tuple(p.shape)} appears twice in one parameter group (AdamW "
                             "would update it twice per step): list it once")
        seen.add(id(p))


def agreed_settings(hypers: Sequence[Any], nonfinite: str,
                    clip: Optional[Tuple[float, float]] = None) -> List[Tuple[str, float]]:
    """What every rank of a sharded optimizer must step with, as (name, value) pairs: each group's
    hyperparameters (a rule's frozen dataclass, its ``user_names`` naming the fields), the ``nonfinite`` policy and
    (``clip_grad_norm_``) its ``(max_norm, norm_type)``."""
    out = [(f"{getattr(h, 'user_names', {}).get(f.name, f.name)} of param group {i}", float(getattr(h, f.name)))
           for i, h in enumerate(hypers) for f in dataclasses.fields(h)]
    codes = ", ".join(f"{i}: {p}" for i, p in enumerate(NONFINITE_POLICIES))
    out.append((f"nonfinite ({codes})", float(NONFINITE_POLICIES.index(nonfinite))))
    if clip is not None:
        out += [("clip_grad_norm_ max_norm", float(clip[0])), ("clip_grad_norm_ norm_type", float(clip[1]))]
    return out


def delayed_setting(value: Union[bool, int]) -> Tuple[bool, int]:
    """``delayed_update`` as (on, exact steps first): True is on from the first step, an int N >= 1 on after N
    exact steps, False (or 0) off."""
    if isinstance(value, bool):
        return value, 0
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"Invalid delayed_update: {value!r} (True, False, or a number N >= 1 of exact steps "
                         "before the updates are delayed)")
    return value > 0, value


def world_without_group(process_group: Optional[Any]) -> int:
    """torch.distributed's world size when it is initialised and no ``process_group`` was given (else 1): the model
    is then likely DDP-wrapped, and DDP averages the gradients only as backward ends."""
    if process_group is not None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size()


def gpu_params(params: Any) -> bool:
    """Whether any of ``params`` (the constructor's, as a list: tensors, ``(name, tensor)`` pairs or group dicts) is
    on a GPU. A model with none has nothing to place: the default placement is then the host's, which measures
    nothing and touches no CUDA (the tests' CUDA stand-ins answer True)."""
    return any(isinstance(p, torch.Tensor) and p.device.type == "cuda" for p in fsdp2.tensors_given(params))


def planned_placement(placement: Any, gpu_model: bool, **options: Any) -> Any:
    """``placement`` as a plan before building takes it, for a model with (``gpu_model``) or without parameters on
    a GPU and the other ``options`` (keywords of :class:`Options`): as given, or None (not given) the constructor's
    default as it settles there (``"auto"``, or ``"host"`` where :meth:`Options.why_host` says so)."""
    if placement is not None:
        return placement
    return "host" if Options(**options).why_host(gpu_model) else "auto"


def _check_nonfinite(value: Any) -> None:
    if value not in NONFINITE_POLICIES:
        raise ValueError(f"Invalid nonfinite policy: {value!r} (expected one of {', '.join(NONFINITE_POLICIES)})")


def _check_bucket_numel(n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"Invalid bucket_numel: {n!r} (a positive number of elements)")


def _check_pin_memory(pin: Any) -> None:
    if pin and not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA, which is not available")


def _check_uploads_in_backward(value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"Invalid uploads_in_backward: {value!r} (True or False)")


def _check_gpu_fraction(f: Any) -> None:
    if not ((isinstance(f, str) and f == "auto")  # (a str: a 1-element array compares equal to one)
            or (isinstance(f, Real) and not isinstance(f, bool) and 0.0 <= f <= 1.0)):
        raise ValueError(f"Invalid gpu_fraction: {f!r} (a number from 0 to 1, or 'auto')")


# Where a bucket's state can live (``placement``): stepped on the host; resident on the GPU (``gpu_fraction``);
# parked on the host between steps and stepped on the GPU.
HOMES = ("host", "resident", "parked")


def _check_placement(p: Any) -> None:
    if isinstance(p, dict):
        bad = [k for k in p if k not in ("resident", "parked")]
        shares = list(p.values())
        if not bad and all(isinstance(v, Real) and not isinstance(v, bool) and 0.0 <= v <= 1.0 for v in shares) \
                and sum(shares) <= 1.0 + 1e-12:
            return
    elif isinstance(p, str) and p in (*HOMES, "auto"):  # (a str: a 1-element array compares equal to one)
        return
    raise ValueError(f"Invalid placement: {p!r} (one of 'host', 'resident', 'parked', 'auto', or a dict of shares of "
                     "each param group's CUDA elements, {'resident': r, 'parked': q} with r + q <= 1: the group's "
                     "first buckets resident, the next parked, the rest on the host)")


def _check_gpu_margin(m: Any) -> None:
    if isinstance(m, bool) or not isinstance(m, Real) or not (0.0 <= m < math.inf) or not _bytes_finite(m):
        raise ValueError(f"Invalid gpu_margin_gib: {m!r} (a finite number of GiB >= 0, whose bytes are finite too)")


def _bytes_finite(gib: Real) -> bool:
    """Whether ``gib`` GiB is a finite number of bytes as a float (the room checks count in bytes: 1e300 GiB is
    not)."""
    try:
        return math.isfinite(float(gib) * 2**30)
    except OverflowError:  # (an int too large for a float)
        return False


def _option(default: Any, doc: str, check: Optional[Callable[[Any], Any]] = None) -> Any:
    """One offload option: its default, its documentation (the constructor's docstring is made of these) and the
    check of its value alone (combinations are checked by :meth:`Options.validate`)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check})


def _context(default: Any) -> Any:
    """What the constructor knows besides the options (no keyword of its own)."""
    return dataclasses.field(default=default, metadata={"context": True})


@dataclasses.dataclass(frozen=True)
class Options:
    """The offload options of one optimizer, each declared once here with its default, its documentation and its
    check, and validated together by :meth:`validate` before anything is allocated. The constructor's signature,
    its docstring, :data:`OFFLOAD_OPTIONS` and ``zero_offload.offload``'s keywords are all made from these fields.

    ``sharded`` says a ``process_group`` was given; ``outside_world`` is :func:`world_without_group`'s answer;
    ``placement_given`` whether ``placement`` was (its default, ``"auto"``, settles to ``"host"`` where it cannot
    run: :meth:`settled`).
    """

    nonfinite: str = _option("raise", """an inf/NaN gradient without a ``GradScaler``: ``"raise"``
        (``RuntimeError`` naming the parameter, nothing updated), ``"skip"`` (the step is skipped, counted in
        :attr:`skipped_steps`) or ``"ignore"`` (no check, as AdamW).""", _check_nonfinite)
    bucket_numel: int = _option(DEFAULT_BUCKET_NUMEL, "soft cap on the elements of one bucket.", _check_bucket_numel)
    pin_memory: Optional[bool] = _option(None, """page-lock the host buffers; None: exactly the buckets on
        CUDA.""", _check_pin_memory)
    stream_grads: Optional[bool] = _option(None, """send each bucket's gradients to the host from backward hooks;
        None: the buckets on CUDA (all with ``delayed_update``; none with ``grads_reduced`` or under DDP).""")
    release_grads: bool = _option(False, """with streaming, set ``p.grad`` to None once its copy is under way
        (then clip only with :meth:`clip_grad_norm_`, no ``GradScaler``, and no other live optimizer over the same
        parameters: refused at backward).""")
    overlap_step: bool = _option(False, """update each streamed bucket in a worker thread during backward, as its
        gradients arrive, with the hyperparameters as they are then (needs ``nonfinite="ignore"``; no clipping or
        ``GradScaler``; 1.35x fused AdamW on an H100 with ``release_grads``, docs/benchmarks.md).""")
    delayed_update: Union[bool, int] = _option(False, """apply each step's update one step late, overlapped with
        the next forward and backward (parameters one step stale). An int N >= 1: the first N steps are exact
        (AdamW's), the later ones delayed; docs/accuracy.md measures what the stale step costs. On a GPU the new
        parameters go up during that backward, into device buffers where the GPU has room (``gpu_margin_gib``
        kept free), and ``step()`` copies them in device to device (``uploads_in_backward``).""",
                                               lambda v: delayed_setting(v))
    process_group: Optional[Any] = _option(None, """shard the state over this data-parallel group (ZeRO): 12/N
        bytes per parameter per rank. Every rank builds the same optimizer and calls ``step()``,
        ``clip_grad_norm_()`` and ``state_dict()`` together, with the same hyperparameters (checked at every step:
        a ``RuntimeError`` naming what differs) and the same number of streamed backward passes.""")
    grads_reduced: bool = _option(False, """the gradients arrive already averaged (DDP): take this rank's slice
        (ZeRO-1). Needs ``process_group``.""")
    timeout: Optional[Union[datetime.timedelta, float]] = _option(None, """the longest one collective may take
        (seconds if a number). Needs ``process_group``; None: 30 minutes.""")
    state_dtype: torch.dtype = _option(torch.float32, """the moments' storage: ``torch.float32`` (exactly AdamW),
        ``torch.bfloat16`` (4 B/param less) or ``torch.int8``: 8-bit block-wise moments (5.875 B/param less). See
        docs/accuracy.md for what that costs in loss; the state dict stays fp32.""", check_state_dtype)
    gpu_fraction: Union[float, str] = _option(0.0, """the share of each param group's CUDA elements whose master
        and moments stay on the GPU ("twin flow"): the group's first buckets, whose gradients backward produces
        last, are updated there by torch's fused AdamW after the same checks as the rest (finite gradients, the
        clip coefficient), while the host updates the others. Costs 8 B per such parameter of GPU memory (fp32
        parameters, which become their own master), 12 B for bf16/fp16 ones; saves their host RAM, transfers and
        host kernel time. ``"auto"``: after the first step, as many of the last-arriving buckets as fit in the
        free GPU memory less ``gpu_margin_gib``. Not with compact ``state_dtype``, ``overlap_step`` or
        ``delayed_update``. See docs/twin-flow.md.""", _check_gpu_fraction)
    placement: Union[str, Dict[str, float]] = _option("auto", """where each GPU bucket's state lives and is stepped:
        ``"host"`` (pinned host memory, stepped by the CPU kernel after backward; gradients down and parameters up
        through PCIe), ``"parked"`` (pinned host memory between steps, brought up to the GPU as the bucket's
        gradients complete in backward, stepped there by the same code as ``"resident"``'s, written back during the
        next forward: 8 B per parameter each way for fp32 parameters, 12 B for bf16/fp16; its gradients and
        parameters stay on the GPU), ``"resident"`` (kept on the GPU, as ``gpu_fraction=1``), a dict of shares of
        each param group's CUDA elements (``{"resident": 0.1, "parked": 0.5}``: the group's first buckets, whose
        gradients backward produces last, resident, the next ones parked, the rest on the host), or ``"auto"``
        (after the first two steps, from what they measured: see docs/placement.md). CPU buckets are stepped on the host
        whatever it says. With a ``process_group`` each rank parks (or keeps) the state of its shard of a bucket, and
        ``"auto"`` places every rank's buckets alike; under FSDP2, each rank's local shards, in the home their bucket
        is given (a GPU home takes over the storage FSDP keeps for them, as one GPU binds a parameter to its slot:
        the same bytes per parameter; ``"auto"``'s homes the same on every rank: see docs/multi-gpu.md). With ``offload(cls)``, a bucket
        stepped on the GPU runs the class's own code there, each parameter whole: a class that is not elementwise
        (Muon, Adafactor, whose factored state a bucket holds in a layout of its own) runs only where no bucket is
        stepped on the host (``"parked"``, ``"resident"``), on one process without FSDP2. Not with ``gpu_fraction``
        (its alias for the resident share), compact ``state_dtype``, ``overlap_step`` or ``delayed_update``, nor
        ``"auto"`` under DDP (torch.distributed initialised and no ``process_group``: the replicas would place
        apart). Left at its default, ``"auto"`` means ``"host"`` where it cannot run (any of those, a model with no
        parameter on a GPU, a class with no GPU update).""",
                                                       _check_placement)
    gpu_margin_gib: float = _option(2.0, """the GPU memory (GiB) left free by ``gpu_fraction="auto"`` and
        ``placement="auto"``'s resident buckets, and by what backward brings up (the uploads of
        ``uploads_in_backward``, a parked bucket's reload: made only where that much and the gradients still to
        come fit; else at ``step()``). The room is within the process's cap where
        ``torch.cuda.set_per_process_memory_fraction`` set one. Finite, and finite in bytes too (1e300 GiB is
        refused).""", _check_gpu_margin)
    uploads_in_backward: bool = _option(True, """with ``delayed_update`` on a GPU: copy each
        bucket's new parameters up during backward, once its update has run, into a device buffer of the bucket's
        size (where the GPU has room for it beyond ``gpu_margin_gib``), and into the parameters device to device at
        ``step()``; the buffers are given back at ``step()``. False: every upload from the host at ``step()``, no
        device memory beyond the parameters (for a run near its GPU memory limit, e.g. with activation
        checkpointing, whose recomputation the room check does not foresee); a parked bucket's state then comes up
        at ``step()`` too.""", _check_uploads_in_backward)
    sharded: bool = _context(False)
    outside_world: int = _context(1)
    placement_given: bool = _context(True)

    @classmethod
    def of(cls, given: Dict[str, Any]) -> "Options":
        """The constructor's offload options (``given``, by name), with what it knows besides them. ``gpu_fraction``
        given without ``placement`` is the placement (its alias for the resident share), as it always was."""
        process_group = given.get("process_group")
        alias = {"placement": "host"} if "gpu_fraction" in given and "placement" not in given else {}
        return cls(**given, **alias, sharded=process_group is not None, placement_given="placement" in given,
                   outside_world=world_without_group(process_group))

    @property
    def replicas(self) -> bool:
        """Whether other ranks may hold replicas of this model, each stepped by an optimizer of its own that no
        collective ties to this one: torch.distributed is initialised and no ``process_group`` was given (DDP,
        likely), unless ``stream_grads=True`` says that nothing reduces the gradients after backward."""
        return self.outside_world > 1 and self.stream_grads is not True

    def why_host(self, gpu_model: bool, rule: Any = None) -> str:
        """Why the default placement, ``"auto"``, means ``"host"`` with these options, for a model with
        (``gpu_model``) or without parameters on a GPU, stepped by ``rule`` ("": it means ``"auto"``)."""
        reasons = ((not gpu_model, "no parameter on a GPU"),
                   (self.gpu_fraction != 0, "gpu_fraction, placement's alias, was given"),
                   (self.state_dtype != torch.float32, f"state_dtype={self.state_dtype}"),
                   (self.overlap_step or self.delayed_update, f"{self._mode}=True"),
                   (self.replicas, f"torch.distributed (world size {self.outside_world}) without a process_group"),
                   (rule is not None and not rule.device_update, f"{getattr(rule, 'name', rule)} has no GPU update"))
        return next((why for hit, why in reasons if hit), "")

    def settled(self, params: Any, rule: Any = None) -> "Options":
        """These options for the constructor's ``params`` stepped by ``rule``: ``placement`` left at its default
        becomes ``"host"`` where ``"auto"`` cannot run (:meth:`why_host`), so that the default never refuses
        what the host placement takes; a placement given is kept (and validated as given)."""
        if self.placement_given or self.placement != "auto" or not self.why_host(gpu_params(params), rule):
            return self
        return dataclasses.replace(self, placement="host")

    def __post_init__(self) -> None:
        for name in ("release_grads", "overlap_step", "grads_reduced"):  # (any truthy value, as before)
            object.__setattr__(self, name, bool(getattr(self, name)))

    @property
    def delayed_exact_steps(self) -> int:
        """``delayed_update=N``: the first N steps are exact (0 for True or False)."""
        return delayed_setting(self.delayed_update)[1]

    @property
    def gpu_tier(self) -> bool:
        """Whether some buckets on a GPU may be stepped there (``gpu_fraction`` not 0, or a ``placement`` other
        than ``"host"``)."""
        return self.gpu_fraction == "auto" or self.gpu_fraction > 0 or self.placement != "host"

    def shares(self) -> Dict[str, float]:
        """The share of each param group's CUDA elements placed in each home at construction, by home
        (``"resident"``, ``"parked"``; the rest on the host): from ``placement``, or ``gpu_fraction`` (its
        alias for the resident share); ``"auto"`` places none at construction."""
        if self.gpu_fraction != "auto" and self.gpu_fraction:
            return {"resident": float(self.gpu_fraction)}
        p = self.placement
        if isinstance(p, dict):
            return {k: float(v) for k, v in p.items() if v}
        return {p: 1.0} if p in ("resident", "parked") else {}

    @property
    def gpu_option(self) -> str:
        """The option that asks for state stepped on a GPU, for messages: ``placement``, or its alias
        ``gpu_fraction``."""
        return "gpu_fraction" if self.placement == "host" else "placement"

    def validate(self) -> "Options":
        """Raise ``ValueError`` naming the first option (or combination) that cannot work; returns ``self``."""
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                check(getattr(self, f.name))
        self._check_modes()
        self._check_distributed()
        self._check_gpu_tier()
        return self

    def _check_gpu_tier(self) -> None:
        f = self.gpu_fraction
        _check_gpu_fraction(f)
        _check_gpu_margin(self.gpu_margin_gib)
        _check_placement(self.placement)
        if f != 0 and self.placement != "host":
            raise ValueError(f"gpu_fraction={f!r} and placement={self.placement!r}: gpu_fraction is placement's "
                             "alias for the resident share; pass one of them")
        if not self.gpu_tier:
            return
        given = f"{self.gpu_option}={getattr(self, self.gpu_option)!r}"
        if self.state_dtype != torch.float32:
            raise ValueError(f"{given} steps state on the GPU, updated by torch's fused AdamW, which holds fp32 state "
                             f"only; state_dtype={self.state_dtype} cannot be combined with it")
        if self.overlap_step or self.delayed_update:
            raise ValueError(f"{given} and {self._mode}=True are not combined: the GPU part is updated at step(), "
                             "after the checks of the whole step")

    @property
    def _mode(self) -> str:
        return "overlap_step" if self.overlap_step else "delayed_update"

    def _check_modes(self) -> None:
        if self.overlap_step and self.delayed_update:
            raise ValueError("overlap_step and delayed_update are alternatives: pass at most one of them")
        if (self.overlap_step or self.delayed_update) and self.stream_grads is False:
            raise ValueError(f"{self._mode}=True needs the gradients streamed in backward: leave stream_grads at "
                             "None or True")
        if self.overlap_step and self.nonfinite != "ignore":
            raise ValueError(
                "overlap_step=True updates each bucket as soon as its gradients are complete, before later buckets' "
                "gradients exist, so a whole step cannot be skipped or refused on an inf/nan: pass "
                "nonfinite='ignore' with it"
            )

    def _check_distributed(self) -> None:
        if not self.sharded and (self.grads_reduced or self.timeout is not None):
            raise ValueError("grads_reduced and timeout only apply with a process_group, and none was given")
        if self.sharded and (self.overlap_step or self.delayed_update):
            raise ValueError("overlap_step and delayed_update are not yet combined with a process_group: a sharded "
                             "bucket is updated at step(), after the gradient statistics are agreed over the group")
        if self.outside_world > 1 and self.stream_grads is None and (
                self.release_grads or self.overlap_step or self.delayed_update):
            option = "release_grads" if self.release_grads else self._mode
            raise ValueError(
                f"{option}=True works on gradients streamed from backward, but torch.distributed is initialised "
                f"(world size {self.outside_world}) and no process_group was given. If the model is "
                "DistributedDataParallel, DDP averages the gradients only when backward ends, after the hooks that "
                "would stream them, so they are taken at step() instead and this option cannot apply. Drop it; or "
                "drop DDP and pass process_group= to shard the state with gradients streamed (ZeRO-2); or pass "
                "stream_grads=True if nothing reduces this model's gradients after backward (as under accelerate's "
                "FSDP2 plugin, which shards the model after the optimizer is built: FSDP2 reduces in backward)."
            )
        given = "placement" if self.placement == "auto" else "gpu_fraction" if self.gpu_fraction == "auto" else ""
        if given and self.replicas:
            fixed = ("a fixed placement, 'host', 'parked', 'resident' or shares such as {'resident': 0.1, 'parked': "
                     "0.5}" if given == "placement" else "a fixed share such as gpu_fraction=0.1")
            raise ValueError(
                f"{given}='auto' with torch.distributed initialised (world size {self.outside_world}) and no "
                "process_group: each rank would measure its own machine and could place a bucket on the host on one "
                "rank and on the GPU on another, where the CPU kernel and torch's fused AdamW round apart, so DDP's "
                "replicas would silently drift. Pass process_group= (the ranks then agree on every bucket's home), "
                f"or {fixed}, which places alike on every rank; or leave {given} unset (the host under DDP)")
        if self.grads_reduced and self.stream_grads:
            raise ValueError("stream_grads=True cannot take gradients already reduced (grads_reduced=True): DDP "
                             "writes its averages into .grad only when backward ends, after the hooks that stream "
                             "them. Leave stream_grads at None with DDP (gradients are then taken at step()).")

    def streams(self, device: torch.device) -> bool:
        """Whether buckets on ``device`` stream their gradients in backward (see ``stream_grads``)."""
        if self.grads_reduced:
            return False  # DDP's averages are final only when backward ends
        if self.stream_grads is not None:
            return self.stream_grads
        if self.outside_world > 1:
            return False  # likewise, if the model is DDP-wrapped
        return device.type == "cuda" or self.delayed_update

    def collective_layout(self) -> Tuple[Tuple[str, Any], ...]:
        """The options that must agree across the ranks of a process group: they shape the buckets and decide which
        collectives run when."""
        # (gpu_fraction: which buckets stay on the device, and "auto" agrees on them with a collective.)
        return tuple((name, getattr(self, name)) for name in ("bucket_numel", "stream_grads", "release_grads",
                                                              "grads_reduced", "state_dtype", "nonfinite",
                                                              "gpu_fraction"))


# The offload options by name, with their defaults: the constructor's keyword-only arguments that are not AdamW's
# (what zero_offload.offload takes besides the wrapped class's own hyperparameters).
OFFLOAD_OPTIONS: Dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Options)
                                   if not f.metadata.get("context")}

# Options that existed and were removed, with why and what to use instead: passing one is a TypeError that says so
# (rather than Python's bare "unexpected keyword argument"), and nothing is built.
_SPECULATION_REMOVED = (
    "was removed with speculation (a bucket's update run in a worker thread during backward and kept at step() "
    "only if exact): it measured slower than the plain step on every GPU run (1.3B GPT on an H100: 2.61x fused "
    "AdamW's step time with speculation against 1.99x without; docs/benchmarks.md), and placement='auto' keeps "
    "the state on the GPU where it fits (1.01x there). Drop it; to take the update off the critical path use "
    "placement='auto' or 'parked' (the state stepped on the GPU), or overlap_step=True (the host update run during "
    "backward; no clipping or GradScaler)")
REMOVED_OPTIONS: Dict[str, str] = {"speculate": _SPECULATION_REMOVED, "speculation_memory": _SPECULATION_REMOVED}


def check_removed(given: Iterable[str], where: str) -> None:
    """Raise ``TypeError`` for the first name of ``given`` that is a removed option (:data:`REMOVED_OPTIONS`),
    saying why it went and what to use instead; ``where`` names the call (``"OffloadOptimizer"``...)."""
    gone = [name for name in given if name in REMOVED_OPTIONS]
    if gone:
        raise TypeError(f"{where}: the option {gone[0]!r} {REMOVED_OPTIONS[gone[0]]}")


def check_option_names(given: Iterable[str]) -> None:
    """The constructor's keyword check: a removed option (:func:`check_removed`), then any other name that is not
    an offload option, as Python's ``TypeError`` for an unexpected keyword argument."""
    check_removed(given, "OffloadOptimizer")
    unknown = sorted(set(given) - set(OFFLOAD_OPTIONS))
    if unknown:
        raise TypeError(f"OffloadOptimizer got an unexpected keyword argument {unknown[0]!r}; its options are "
                        f"AdamW's and {', '.join(OFFLOAD_OPTIONS)}")


def option_docs(indent: str = "        ") -> str:
    """The ``Args:`` entries of the offload options for a docstring, from their declarations."""
    out = []
    for f in dataclasses.fields(Options):
        if f.metadata.get("context"):
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        doc = " ".join(f.metadata["doc"].split())
        words, line, lines = doc.split(), f"{indent}{f.name} ({kind}): ", []
        for w in words + [f"Default: {f.default!r}."]:
            if len(line) + len(w) + 1 > 116:
                lines.append(line.rstrip())
                line = indent + "    "
            line += w + " "
        lines.append(line.rstrip())
        out.extend(lines)
    return "\n".join(out)

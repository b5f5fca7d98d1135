"""``python -m zero_offload.report``: what this machine has, what was built, and which path the kernel takes; with
``--params N``, what an :class:`~zero_offload.OffloadOptimizer` would allocate for a model of N parameters.

Without arguments it prints the machine report: paste it into bug reports. It builds (or loads from cache) the
native kernel, so its first run may take a minute.

With ``--params`` (``7B``, ``350M``, ``1.3e9``...) it prints a memory plan and allocates nothing: the host
buffers come from :meth:`OffloadOptimizer.estimate_host_memory` run over meta tensors (shape and dtype, no
storage), so they are the bytes the optimizer's own bucket layout would allocate; the GPU side and the
``torch.optim.AdamW`` column are the parameters, gradients and state those optimizers keep there. Activations,
the CUDA context and allocator caches are not counted, nor, with ``--fsdp N`` and ``--params``, FSDP2's
all-gathered units (the plan says what a unit costs per parameter under ``--param-dtype`` and ``--reduce-dtype``,
FSDP2's ``MixedPrecisionPolicy``; ``--dtype`` is then the shards' storage dtype). With ``--model`` the plan knows
the units (``--fsdp-units``: each block and the root, or the whole model): each rank's buckets are cut at them as
the optimizer cuts them, and FSDP2's own GPU memory (the gathered units, their gradients, the reduce-scatter input:
:func:`~zero_offload.fsdp_units.gathered_bytes`) is in the GPU rows. Beside AdamW's column, a low-precision
model gets AdamW's two recipes: all in the low dtype, and with fp32 masters. Options: ``--dtype``,
``--state-dtype``, ``--amsgrad``, ``--device``, ``--world-size``, ``--fsdp``, ``--param-dtype``,
``--reduce-dtype``, ``--fsdp-units``, ``--bucket-numel``, ``--placement``; ``--help`` lists them. Under the
table, each home's (``--placement``: host, parked, resident) buckets, host RAM, GPU memory, bytes copied each way
per step and the predicted time of the CPU kernel and of the copies: from rates measured here where there is a
GPU, else from the cost model's assumed ones (the plan says which, and where they come from).
"""

from __future__ import annotations

import argparse
import decimal
import json
import os
import platform
import re
import sys
from typing import List, Optional, Sequence, Tuple

import torch

import zero_offload
from zero_offload import _build, affinity, functional
from zero_offload.cost_model import rates_here
from zero_offload.fsdp_units import UNIT_CHOICES, model_units
from zero_offload.host_memory import available_host_bytes, huge_pages
# (The plan's names are this module's too: the command-line tool and its tests import them from here.)
from zero_offload.memory_plan import (MAX_COUNT, MemoryPlan, _DTYPES, _STATE_DTYPES, _check_gpu_fraction,  # noqa: F401
                                      count_plan, fsdp_plan, memory_plan, meta_params, parse_count)
from zero_offload.plan_text import gpu_capacity, plan_dict, plan_lines, verdict_lines, verdicts  # noqa: F401
from zero_offload.options import DEFAULT_BUCKET_NUMEL, DTYPE_NAMES, dtypes_by_name, planned_placement  # noqa: F401


def cpu_features() -> Tuple[str, List[str]]:
    """CPU model name and the SIMD features the kernel cares about, from /proc/cpuinfo where there is one."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass
    wanted = ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16", "avx2", "fma", "f16c",
              "asimd", "asimdhp", "sve", "bf16"]
    return model, [f for f in wanted if f in flags]


def items() -> List[Tuple[str, str]]:
    """The machine report, as (label, value) pairs: one text line each, and one JSON key each (see
    :func:`json_key`)."""
    model, flags = cpu_features()
    out = [
        ("zero_offload", zero_offload.__version__),
        ("torch", torch.__version__),
        ("python", f"{sys.version.split()[0]} on {platform.platform()}"),
        ("cpu", f"{model}, {os.cpu_count()} logical cores"),
        ("cpu features", " ".join(flags) or "none detected"),
        ("threads", f"{torch.get_num_threads()} (torch.set_num_threads / OMP_NUM_THREADS)"),
        ("kernel threads", affinity.status()),
    ]
    _build.load_native()
    st = _build.status()
    out.append(("native kernel", st.summary()))
    where = f"root {_build.cache_root()}: ZERO_OFFLOAD_CACHE_DIR or TORCH_EXTENSIONS_DIR moves it"
    if st.refused:
        out.append(("build cache", f"not used: {st.refused}; this process built a private copy in {st.cache_dir}, "
                                   "removed once loaded"))
    else:
        out.append(("build cache", f"{st.cache_dir or '-'} ({where})"))
    out.append(("native ISAs", ", ".join(_build.native_isas()) or "none"))
    try:
        chosen = functional.path_reason()
    except (ValueError, RuntimeError) as exc:
        chosen = f"error: {exc}"
    out.append(("path chosen", chosen))
    out.append(("huge pages", huge_pages()))
    if torch.cuda.is_available():
        out.append(("cuda", f"{torch.version.cuda}, {torch.cuda.device_count()} device(s): "
                            f"{torch.cuda.get_device_name(0)}"))
        try:
            torch.empty(1, pin_memory=True)
            out.append(("pinned memory", "available"))
        except RuntimeError as exc:
            out.append(("pinned memory", f"unavailable: {exc}"))
    else:
        out.append(("cuda", "not available (pinned host memory needs CUDA; host buffers are pageable)"))
    return out


def json_key(label: str) -> str:
    """A report label as its JSON key: ``"cpu features"`` is ``"cpu_features"``."""
    return label.lower().replace(" ", "_")


def lines(report: Optional[List[Tuple[str, str]]] = None) -> List[str]:
    """The machine report as text, one line per item (of ``report``, default: :func:`items`)."""
    return [f"{label:<17}{value}" for label, value in (items() if report is None else report)]


# ------------------------------------------------------------------------------------------------ memory plan --
def hf_meta_model(model: str) -> torch.nn.Module:
    """A Hugging Face model built on the meta device from its config (shapes only: no weights downloaded or
    allocated): its parameters, and its modules, where FSDP2's units are
    (:func:`~zero_offload.fsdp_units.model_units`).

    Args:
        model (str): a local ``config.json`` (or a folder holding one: works offline) or a hub model id (needs
            network access, or the Hugging Face cache).

    Raises:
        RuntimeError: without ``transformers``, or when the config cannot be had (with the reason).
    """
    try:
        import transformers
    except ImportError:
        raise RuntimeError("--model needs the transformers package (pip install transformers)") from None
    try:
        config = transformers.AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:
        hint = "" if os.path.exists(model) else (" (not a local path: a hub model id needs network access or the "
                                                 "Hugging Face cache; a local config.json works offline)")
        raise RuntimeError(f"could not load a model config from {model!r}{hint}: {exc}") from None
    with torch.device("meta"):  # shapes only: nothing is allocated, whatever the size
        try:
            net = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM (an encoder, say)
            net = transformers.AutoModel.from_config(config)
    return net


def _count_arg(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The options of a memory plan and their defaults (None in the parser, so that one given without --params or
# --model is noticed and refused instead of silently ignored).
_PLAN_DEFAULTS = {"dtype": "fp32", "device": "cuda", "state_dtype": "fp32", "amsgrad": False, "world_size": 1,
                  "bucket_numel": DEFAULT_BUCKET_NUMEL, "release_grads": False, "nproc_per_node": 1, "fsdp": 1,
                  "gpu_memory": None, "gpu_fraction": 0.0, "param_dtype": None, "reduce_dtype": None,
                  "placement": None, "fsdp_units": None}  # (placement None: the optimizer's default, as it settles)


def _placement_arg(text: str):
    """``--placement``: a home (``host``, ``parked``, ``resident``), ``auto``, or shares such as
    ``resident=0.1,parked=0.5`` (the optimizer's dict); the optimizer's own check of the value."""
    from zero_offload.options import _check_placement

    value = text.strip()
    if "=" in value:
        shares = {}
        for part in value.split(","):
            home, _, share = part.partition("=")
            if home.strip() in shares:  # (a dict keeps the last: the user's first share would vanish unsaid)
                raise argparse.ArgumentTypeError(f"Invalid placement: {text!r} (the share of {home.strip()!r} given "
                                                 "twice)")
            try:
                shares[home.strip()] = float(share)
            except ValueError:
                raise argparse.ArgumentTypeError(f"Invalid placement: {text!r} (a share is a number from 0 to 1, "
                                                 "e.g. resident=0.1,parked=0.5)") from None
        value = shares
    try:
        _check_placement(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m zero_offload.report``."""
    prog = "python -m zero_offload" if sys.argv[0].endswith("__main__.py") else "python -m zero_offload.report"
    ap = argparse.ArgumentParser(prog=prog, description=_DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=_count_arg, metavar="N",
                    help="print the memory plan for a model of N parameters (7B, 350M, 1.3e9...) instead of the "
                         "machine report")
    ap.add_argument("--dtype", choices=sorted(_DTYPES),
                    help="the model's parameter dtype as built (default: fp32); with --fsdp, the dtype FSDP2 stores "
                         "the shards in, which the optimizer updates (the compute dtype is --param-dtype)")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    help="where the model trains (default: cuda)")
    ap.add_argument("--state-dtype", choices=list(_STATE_DTYPES),
                    help="the optimizer's state_dtype: fp32 (exactly AdamW), bf16, or int8 (8-bit block-wise moments)"
                         " (default: fp32)")
    ap.add_argument("--amsgrad", action="store_true", default=None, help="plan for amsgrad=True (one more moment buffer)")
    ap.add_argument("--world-size", type=int, metavar="N",
                    help="data-parallel ranks sharing the host buffers (arithmetic estimate; default: 1)")
    ap.add_argument("--fsdp", type=int, metavar="N",
                    help="plan one rank of an FSDP2 run (fully_shard) over N ranks: the parameters sharded by FSDP2, "
                         "each rank's optimizer offloading the state of its own shards (default: no FSDP2; not with "
                         "--world-size or --gpu-fraction; --nproc-per-node defaults to N)")
    ap.add_argument("--param-dtype", choices=sorted(_DTYPES),
                    help="with --fsdp: FSDP2's MixedPrecisionPolicy(param_dtype=...), the dtype the shards are "
                         "all-gathered and computed in (default: --dtype, as with no policy); --dtype is then the "
                         "shards' storage dtype, the model's as built, which the optimizer updates")
    ap.add_argument("--reduce-dtype", choices=sorted(_DTYPES),
                    help="with --fsdp: FSDP2's MixedPrecisionPolicy(reduce_dtype=...), the dtype gradients are "
                         "reduce-scattered in (default: --param-dtype); FSDP2 keeps the gradient shards in --dtype")
    ap.add_argument("--fsdp-units", choices=UNIT_CHOICES,
                    help="with --fsdp and --model: the modules given fully_shard. per-block (default): each "
                         "transformer block (the model's _no_split_modules, else the children of its largest "
                         "ModuleList of one class), then the root with the rest (embeddings, final norm, head); "
                         "whole: fully_shard(model) alone. The optimizer's buckets are cut at each unit, and the "
                         "GPU rows count the units FSDP2 gathers")
    ap.add_argument("--bucket-numel", type=int, metavar="N",
                    help="elements per bucket, as for the optimizer (default: 2**25)")
    ap.add_argument("--model", metavar="CONFIG_OR_ID",
                    help="plan for a Hugging Face model instead of --params: a local config.json (or its folder; "
                         "works offline) or a hub model id (needs network); needs transformers")
    ap.add_argument("--release-grads", action="store_true", default=None,
                    help="plan for release_grads=True: the GPU holds at most two buckets' gradients")
    ap.add_argument("--gpu-fraction", type=float, metavar="F",
                    help="plan for gpu_fraction=F (0 to 1): the first buckets keep their state on the GPU "
                         "(default: 0)")
    ap.add_argument("--placement", type=_placement_arg, metavar="HOME",
                    help="plan for placement=HOME: host, parked, resident, auto (the default, which means host for "
                         "--device cpu, --gpu-fraction or a compact --state-dtype; planned as every bucket on the "
                         "host: upper bounds), or shares of the GPU buckets such as resident=0.1,parked=0.5; "
                         "the homes' table under the plan shows each one's memory, traffic and kernel time per step")
    ap.add_argument("--nproc-per-node", type=int, metavar="N",
                    help="ranks per node: their host buffers add up in the node's RAM (default: 1)")
    ap.add_argument("--gpu-memory", type=_bytes_arg, metavar="SIZE",
                    help="memory of one GPU for the GPU verdict: 80GB (GB = 10**9 bytes, as GPUs are sold), 24GiB "
                         "(GiB = 2**30 bytes; also kB/MB/TB, KiB/MiB/TiB) or a plain number of bytes (default: this "
                         "machine's GPU 0)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m zero_offload.report``; see the module docstring.

    Args:
        argv (Sequence[str], optional): command-line arguments. Default: ``sys.argv[1:]``.
    """
    ap = _parser()
    args = ap.parse_args(argv)
    given = [f"--{name.replace('_', '-')}" for name in _PLAN_DEFAULTS if getattr(args, name) is not None]
    if args.params is None and args.model is None and given:
        ap.error(f"{', '.join(given)} only apply to a memory plan: give --params N or --model CONFIG_OR_ID too")
    policy = [f"--{name.replace('_', '-')}" for name in ("param_dtype", "reduce_dtype") if getattr(args, name)]
    if policy and (args.fsdp or 1) < 2 and (args.params is not None or args.model is not None):
        ap.error(f"{', '.join(policy)} set FSDP2's MixedPrecisionPolicy: give --fsdp N (N > 1) too")
    if args.fsdp_units is not None and (args.params is not None or args.model is not None):
        if args.model is None or (args.fsdp or 1) < 2:
            ap.error("--fsdp-units needs --model CONFIG_OR_ID and --fsdp N (N > 1): the planner knows the units of "
                     "a model it can see (with --params the units are unknown)")
    if args.fsdp is not None and args.nproc_per_node is None:
        args.nproc_per_node = args.fsdp  # (FSDP2's ranks, on one node unless said)
    for name, default in _PLAN_DEFAULTS.items():  # None above: given or not
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.params is None and args.model is None:
        report = items()
        print(json.dumps({json_key(label): value for label, value in report}) if args.json
              else "\n".join(lines(report)))
        return
    for name in ("fsdp", "world_size", "bucket_numel", "nproc_per_node"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.params is not None and args.model is not None:
        ap.error("give --params or --model, not both")
    _print_plan(args, ap)


def _print_plan(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """The memory plan and its verdicts for ``main``'s arguments, as text or JSON."""
    dtype = _DTYPES[args.dtype]
    model_name, units = None, None
    if args.model is not None:
        try:
            net = hf_meta_model(args.model)
        except RuntimeError as exc:
            ap.exit(2, f"python -m zero_offload.report: error: {exc}\n")
        model_name = type(net).__name__
        params = [torch.empty(p.shape, dtype=dtype, device="meta") for p in net.parameters()]
        if args.fsdp > 1:
            units = model_units(net, args.fsdp_units or "per-block")
    else:
        params = None
    state_dtype = _STATE_DTYPES[args.state_dtype]
    placement = planned_placement(args.placement, args.device == "cuda", state_dtype=state_dtype,
                                  gpu_fraction=args.gpu_fraction)
    kw = dict(device=args.device, amsgrad=args.amsgrad, world_size=args.world_size, bucket_numel=args.bucket_numel,
              state_dtype=state_dtype, release_grads=args.release_grads, gpu_fraction=args.gpu_fraction,
              placement=placement)
    try:
        _check_gpu_fraction(args.gpu_fraction, args.device, state_dtype, placement)
    except ValueError as exc:
        ap.error(str(exc))
    if args.fsdp > 1:
        try:
            plan = fsdp_plan(params, args.params or 0, dtype, args.fsdp, param_dtype=_DTYPES.get(args.param_dtype),
                             reduce_dtype=_DTYPES.get(args.reduce_dtype), units=units, **kw)
        except ValueError as exc:
            ap.error(f"--fsdp: {exc}")
    else:
        plan = memory_plan(params, **kw) if params is not None else count_plan(args.params, dtype, **kw)
    gpu = args.gpu_memory if args.gpu_memory is not None else (gpu_capacity() if args.device == "cuda" else None)
    host = available_host_bytes()
    v = verdicts(plan, args.nproc_per_node, gpu, host)
    rates = rates_here()  # (measured where there is a GPU, else assumed: the plan says which)
    if args.json:
        data = plan_dict(plan, v, args.nproc_per_node, gpu, host, rates)
        print(json.dumps({"model": model_name or args.model, **data}, indent=2))
        return
    out = plan_lines(plan, rates)
    if model_name is not None:
        out.insert(0, f"model            {args.model}: {model_name}, {plan.model_numel or plan.numel:,} parameters "
                      "(meta-device init)")
    print("\n".join(out + verdict_lines(plan, v, args.nproc_per_node, gpu, host)))


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}


def _bytes_arg(text: str) -> int:
    """A size with its unit said: decimal ``GB`` (10**9) or binary ``GiB`` (2**30), or plain bytes; a bare ``G``
    is refused, since it could mean either. Read as a decimal (a float made 1e999 infinite, and 0.4 a 0-byte GPU
    without a word): from 1 byte to :data:`MAX_COUNT` bytes, rounded to a whole byte."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text, re.IGNORECASE)
    if m is None or m.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"Invalid size: {text!r} (expected e.g. 80GB = 80*10**9 bytes, 24GiB = "
                                         "24*2**30 bytes, or a plain number of bytes such as 8e10)")
    # (Exponents as large as decimals take: 1e999999999 is compared, not multiplied into an overflow.)
    with decimal.localcontext(decimal.Context(prec=60, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)):
        size = decimal.Decimal(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if size > MAX_COUNT:  # (compared as a decimal: the int of 1e999999999 would take minutes to make)
        raise argparse.ArgumentTypeError(f"Invalid size: {text!r} (more than {MAX_COUNT} bytes, 9.2 EB: no GPU "
                                         "has that much memory)")
    if size < 1:
        raise argparse.ArgumentTypeError(f"Invalid size: {text!r} (less than one byte; a GPU's memory, e.g. 80GB "
                                         "or 24GiB, or a plain number of bytes such as 8e10)")
    return int(size.to_integral_value(decimal.ROUND_HALF_EVEN))


_DESCRIPTION = """\
Without arguments: what this machine has, what was built and which kernel path runs (paste it into bug
reports; the first run may compile the kernel, about a minute).

With --params N or --model CONFIG_OR_ID: what OffloadOptimizer would keep on the GPU and in host RAM per rank,
beside torch.optim.AdamW, and whether that fits: host RAM for all --nproc-per-node ranks of a node together,
GPU memory per rank (this machine's GPU 0, or --gpu-memory). Nothing is allocated: the host buffers come from
the optimizer's own estimate over meta tensors. Activations, the CUDA context and allocator caches are not
counted, nor, with --fsdp and --params, FSDP2's all-gathered units (the plan says what one costs per parameter;
with --model it knows the units, cuts each rank's buckets at them and counts FSDP2's own GPU memory). A bf16 or
fp16 model is also compared with AdamW keeping fp32 masters (fp32 parameters, gradients and moments: autocast,
or FSDP2's MixedPrecisionPolicy over fp32 shards).

examples:
  python -m zero_offload.report --params 7B --dtype bf16 --gpu-memory 80GB
  python -m zero_offload.report --params 7B --dtype bf16 --world-size 8 --nproc-per-node 8 --release-grads
  python -m zero_offload.report --params 1.3B --placement resident=0.1,parked=0.5 --gpu-memory 80GB
  python -m zero_offload.report --model path/to/config.json --dtype bf16 --json
  python -m zero_offload.report --model path/to/config.json --fsdp 8 --param-dtype bf16 --reduce-dtype fp32
"""


if __name__ == "__main__":
    main()

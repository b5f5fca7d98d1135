"""OffloadOptimizer inside the trainers people use: Hugging Face ``transformers.Trainer``, PyTorch Lightning, and a
model under ``torch.compile``. Each runs the same training twice, with ``torch.optim.AdamW(foreach=False)`` and with
``OffloadOptimizer``, and the parameters must agree at default ``torch.testing.assert_close`` tolerance; then a
checkpoint saved by the trainer mid-run must resume onto the uninterrupted trajectory. The scripts in examples/
are run too, so they cannot rot.

Everything runs on the CPU. A test is skipped when its package is absent (``pip install -e ".[integrations]"``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from aliasing import lies_in
from zero_offload import OffloadOptimizer

REPO = Path(__file__).resolve().parents[1]
LR, WD = 3e-3, 0.1


def adamw(params, **kw) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, foreach=False, **kw)


def assert_same_params(reference: nn.Module, candidate: nn.Module, where: str) -> None:
    for (name, p), q in zip(reference.named_parameters(), candidate.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{where}, {name}: {m}")


def assert_differs(a: nn.Module, b: nn.Module) -> None:
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ------------------------------------------------------------------------------------ Hugging Face Trainer --
class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences as causal-LM examples (the model shifts the labels itself)."""

    def __init__(self, n: int = 64, seq: int = 16, vocab: int = 97):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_train(make_opt: Callable, out: Path, steps: int = 8, save_steps: int = 0, resume: str = None,
             max_grad_norm: float = 1.0, build_in_trainer: bool = False):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # Tiny GPT-2 from a config (no download, no tokenizer), dropout off so both runs see the same function.
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, use_cpu=True, report_to="none",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, logging_steps=1, seed=0,
        disable_tqdm=True, max_grad_norm=max_grad_norm, weight_decay=WD,
    )
    if build_in_trainer:  # the Trainer builds it (its decay groups, after placing the model) and its scheduler
        cls, kw = (torch.optim.AdamW, {"foreach": False}) if make_opt is adamw else (make_opt, {})
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(),
                                       optimizer_cls_and_kwargs=(cls, {"lr": LR, **kw}))
    else:
        opt = make_opt(model.parameters(), lr=LR, weight_decay=WD)
        sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=steps)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses, trainer


def test_hf_trainer_matches_adamw(tmp_path):
    ref, ref_losses, _ = hf_train(adamw, tmp_path / "adamw")
    ours, losses, trainer = hf_train(OffloadOptimizer, tmp_path / "ours")
    assert isinstance(trainer.optimizer.optimizer, OffloadOptimizer)  # accelerate's wrapper around ours
    assert len(losses) == 8
    torch.testing.assert_close(losses, ref_losses)
    assert_same_params(ref, ours, "after 8 Trainer steps")
    # The Trainer's default max_grad_norm=1.0 clipped some of those steps (torch.nn.utils.clip_grad_norm_ on the
    # params, which keep their gradients): without it the trajectory differs.
    unclipped, _, _ = hf_train(OffloadOptimizer, tmp_path / "unclipped", max_grad_norm=0.0)
    assert_differs(ours, unclipped)


def test_hf_trainer_builds_it_from_optimizer_cls_and_kwargs(tmp_path):
    ref, ref_losses, _ = hf_train(adamw, tmp_path / "adamw", build_in_trainer=True)
    ours, losses, trainer = hf_train(OffloadOptimizer, tmp_path / "ours", build_in_trainer=True)
    assert isinstance(trainer.optimizer.optimizer, OffloadOptimizer)
    assert [g["weight_decay"] for g in trainer.optimizer.optimizer.param_groups] == [WD, 0.0]  # the Trainer's groups
    torch.testing.assert_close(losses, ref_losses)
    assert_same_params(ref, ours, "after 8 Trainer steps, optimizer built by the Trainer")


def test_hf_trainer_checkpoint_resumes_the_same_trajectory(tmp_path):
    full, _, _ = hf_train(OffloadOptimizer, tmp_path / "full")
    hf_train(OffloadOptimizer, tmp_path / "run", save_steps=4)
    checkpoint = tmp_path / "run" / "checkpoint-4"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert {"step", "exp_avg", "exp_avg_sq"} <= set(saved["state"][0])  # AdamW's format
    resumed, _, _ = hf_train(OffloadOptimizer, tmp_path / "resumed", resume=str(checkpoint))
    assert_same_params(full, resumed, "resumed at step 4 of 8")


# ------------------------------------------------------------------------------------------------ Lightning --
VOCAB, SEQ = 50, 12


def lightning_module(use_offload: bool, steps: int):
    L = pytest.importorskip("lightning")

    class TinyLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64),
                                     nn.Linear(64, VOCAB))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x).reshape(-1, VOCAB), y.reshape(-1))

        def configure_optimizers(self):
            make = OffloadOptimizer if use_offload else adamw
            opt = make(self.parameters(), lr=LR, weight_decay=WD)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=steps)  # cycles betas too
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    return TinyLM()


def lightning_fit(use_offload: bool, root: Path, steps: int = 12, stop_at: int = None, ckpt_path: str = None,
                  clip: float = 0.5):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = lightning_module(use_offload, steps)
    x = torch.randint(0, VOCAB, (48, SEQ), generator=torch.Generator().manual_seed(0))
    # 6 batches an epoch, in order, so that a checkpoint at step 6 closes an epoch and resuming replays the rest.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(1, 1)), batch_size=8)
    callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=stop_at)] if stop_at else []
    trainer = L.Trainer(accelerator="cpu", max_steps=stop_at or steps, gradient_clip_val=clip, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(stop_at),
                        callbacks=callbacks, default_root_dir=root)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, trainer


def test_lightning_matches_adamw(tmp_path):
    ref, _ = lightning_fit(False, tmp_path / "adamw")
    ours, trainer = lightning_fit(True, tmp_path / "ours")
    assert isinstance(trainer.optimizers[0], OffloadOptimizer)
    assert trainer.global_step == 12
    assert_same_params(ref, ours, "after 12 Lightning steps")
    unclipped, _ = lightning_fit(True, tmp_path / "unclipped", clip=None)
    assert_differs(ours, unclipped)  # gradient_clip_val=0.5 took effect


def test_lightning_checkpoint_resumes_the_same_trajectory(tmp_path):
    full, _ = lightning_fit(True, tmp_path / "full")
    lightning_fit(True, tmp_path / "run", stop_at=6)
    (ckpt,) = (tmp_path / "run" / "ckpt").glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert {"step", "exp_avg", "exp_avg_sq"} <= set(saved["state"][0])  # AdamW's format
    resumed, trainer = lightning_fit(True, tmp_path / "resumed", ckpt_path=str(ckpt))
    assert trainer.global_step == 12
    # Lightning's restore (load_state_dict, then moving state "to the device") must leave the state as views of
    # the optimizer's host buffers, or state_dict() would go stale.
    opt = trainer.optimizers[0]
    bufs = [b["exp_avg"] for b in opt.host_buffers()]
    assert len(opt.state) == len(list(resumed.parameters()))
    for state in opt.state.values():
        assert lies_in(state["exp_avg"], bufs)
    assert_same_params(full, resumed, "resumed at step 6 of 12")


def _two_steps_with_lightning_state_move(monkeypatch):
    """Step, then what Lightning's restore does after ``load_state_dict`` (``_optimizer_to_device``: every state
    tensor but ``step`` replaced by its copy on the model's device), then step again; returns ours and AdamW."""
    pytest.importorskip("lightning")
    from lightning.fabric.utilities import optimizer as fabric_optimizer

    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    ref = copy.deepcopy(model)
    opt, ref_opt = OffloadOptimizer(model.parameters(), lr=LR), adamw(ref.parameters(), lr=LR)
    x = torch.randn(4, 6)
    for step in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            (m(x) * (step + 1)).square().sum().backward()
            o.step()
            o.zero_grad()
        if step == 0:
            # On a CUDA model the move makes copies on the GPU; on the CPU .to() would return the tensor itself,
            # so a clone stands in for the copy.
            monkeypatch.setattr(fabric_optimizer, "move_data_to_device", lambda t, device: t.clone())
            fabric_optimizer._optimizer_to_device(opt, "cpu")
            assert not lies_in(opt.state[model.weight]["exp_avg"], [b["exp_avg"] for b in opt.host_buffers()]), \
                "the stand-in did not replace the state tensors"
    return opt, ref_opt, model, ref


def test_lightning_restore_on_a_gpu_model_keeps_state_dict_live(monkeypatch):
    """Lightning's restore replaces the state tensors with device copies; the optimizer points its state back at
    the host buffers, so state_dict() stays live (and no copy of the state stays on the GPU)."""
    opt, ref_opt, model, ref = _two_steps_with_lightning_state_move(monkeypatch)
    sd = opt.state_dict()["state"]
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(sd[i]["exp_avg"], ref_opt.state[q]["exp_avg"])
        torch.testing.assert_close(sd[i]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])


# -------------------------------------------------------------------------------------------- torch.compile --
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.fc1, self.ln, self.fc2 = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, VOCAB)

    def forward(self, x):
        return self.fc2(self.ln(F.gelu(self.fc1(self.emb(x)))))


def compiled_train(model: nn.Module, opt: torch.optim.Optimizer, forward: Callable, steps: int = 8) -> None:
    for step in range(steps):
        x = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(step))
        F.cross_entropy(forward(x).reshape(-1, VOCAB), x.roll(1, 1).reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def compiled_reference():
    pytest.importorskip("torch._inductor")
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Net()
    ref = copy.deepcopy(base)
    compiled_train(ref, adamw(ref.parameters(), lr=LR, weight_decay=WD), torch.compile(ref))
    return base, ref


def _compile_then_build(model):
    forward = torch.compile(model)
    return OffloadOptimizer(model.parameters(), lr=LR, weight_decay=WD), forward


def _build_then_compile(model):
    opt = OffloadOptimizer(model.parameters(), lr=LR, weight_decay=WD)
    return opt, torch.compile(model)


def _compile_run_then_build(model):
    # Compiled code already exists (and has run) when the optimizer rebinds the parameters' .data.
    forward = torch.compile(model)
    x = torch.zeros(2, SEQ, dtype=torch.long)
    forward(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return OffloadOptimizer(model.parameters(), lr=LR, weight_decay=WD), forward


def _build_then_module_compile(model):
    opt = OffloadOptimizer(model.parameters(), lr=LR, weight_decay=WD)
    model.compile()  # in place: nn.Module.compile
    return opt, model


@pytest.mark.parametrize("setup", [_compile_then_build, _build_then_compile, _compile_run_then_build,
                                   _build_then_module_compile], ids=lambda f: f.__name__.strip("_"))
def test_compiled_model_matches_compiled_adamw(compiled_reference, setup):
    base, ref = compiled_reference
    model = copy.deepcopy(base)
    opt, forward = setup(model)
    # Parameters rebound to views of the optimizer's buffers must not make dynamo recompile.
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled_train(model, opt, forward)
    assert_same_params(ref, model, setup.__name__)


# ------------------------------------------------------------------------------------- accelerate's FSDP2 --
def _accelerate_fsdp2_worker(rank: int, world: int, optimizer: str, ours_kw: Optional[dict] = None):
    """What ``Accelerator.prepare(model, optimizer)`` does with its FSDP2 plugin (``_prepare_fsdp2``), step by step
    (accelerate takes FSDP only on GPUs: on CPU it would not shard): the optimizer built over the plain model, each
    listed parameter swapped for a placeholder carrying its ``data_ptr``, ``fully_shard``, then accelerate's own
    ``fsdp2_switch_optimizer_parameters`` with the mapping it builds; then four clipped steps (with
    ``release_grads`` by ``opt.clip_grad_norm_``: torch's clip would find no gradient). Each step's full
    parameters."""
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters

    import fsdp2_harness as h

    torch.manual_seed(0)
    model = h.Net()
    make = adamw if optimizer == "adamw" else OffloadOptimizer
    ours_kw = ours_kw or {}
    opt = make(model.parameters(), lr=h.LR, weight_decay=h.WEIGHT_DECAY, **ours_kw)
    old = {name: p.data_ptr() for name, p in model.named_parameters()}
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1, dtype=p.dtype)
            group["params"][i].data_ptr = p.data_ptr()
    h.build_model(world, h.RECIPES["plain"], model=model)
    fsdp2_switch_optimizer_parameters(opt, {old[name]: p for name, p in model.named_parameters()})
    steps = []
    for step in range(4):
        opt.zero_grad()
        h.loss_on(model, step, 0, rank, world).backward()
        if ours_kw.get("release_grads"):
            opt.clip_grad_norm_(h.CLIP)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), h.CLIP)
        opt.step()
        steps.append({name: p.full_tensor() for name, p in model.named_parameters()})
    return steps


@pytest.mark.parametrize("ours_kw", [{}, dict(release_grads=True, stream_grads=True)], ids=["default", "released"])
def test_accelerate_fsdp2_preparation_hands_ours_the_shards(ours_kw):
    """Ours built before accelerate shards the model lays itself out again over the shards at its first step, and
    trains as AdamW does under the same preparation (2 ranks, gloo). ``release_grads`` there takes
    ``stream_grads=True`` (built in an initialised process group, ours cannot tell DDP from the sharding to come)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
    from test_distributed import launch

    reference = launch(_accelerate_fsdp2_worker, 2, "adamw", timeout=180)[0]
    ours = launch(_accelerate_fsdp2_worker, 2, "ours", ours_kw, timeout=180)[0]
    assert len(ours) == len(reference) == 4
    for step, (a, b) in enumerate(zip(reference, ours)):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], msg=lambda m: f"step {step}, {name}: {m}")
    assert any(not torch.equal(reference[0][n], reference[-1][n]) for n in reference[0])  # it trained


# ------------------------------------------------------------------------------------ accelerate on 2 CPUs --
def _accelerate_ddp_worker(rank: int, world: int, optimizer: str):
    """``Accelerator(cpu=True).prepare(model, opt)`` on 2 gloo ranks (DDP; ``prepare`` moves the model with
    ``model.to(torch.device("cpu", 0))``, which copies its parameters), then four steps clipped with
    ``accelerator.clip_grad_norm_``, each rank its half of the batch. Each step's parameters."""
    import accelerate

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")  # (the group is up already: accelerate takes it as it is)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    make = adamw if optimizer == "adamw" else OffloadOptimizer
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, make(model.parameters(), lr=LR, weight_decay=WD))
    steps = []
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        half = slice(rank * 4, rank * 4 + 4)
        loss = F.mse_loss(model(x[half]), y[half])
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        steps.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return steps


def test_accelerate_prepare_on_two_cpu_processes_trains_as_adamw():
    """accelerate's ``prepare(model, opt)`` copies the parameters onto ``cpu:0`` after the optimizer was built: the
    optimizer follows them, as AdamW does, and the run equals AdamW's under the same preparation."""
    pytest.importorskip("accelerate")
    from test_distributed import launch

    reference = launch(_accelerate_ddp_worker, 2, "adamw", timeout=180)
    ours = launch(_accelerate_ddp_worker, 2, "ours", timeout=180)
    for rank in range(2):
        assert len(reference[rank]) == len(ours[rank]) == 4
        for step, (a, b) in enumerate(zip(reference[rank], ours[rank])):
            for name in a:
                torch.testing.assert_close(b[name], a[name], msg=lambda m: f"rank {rank} step {step} {name}: {m}")
    first, last = reference[0][0], reference[0][-1]
    assert any(not torch.equal(first[n], last[n]) for n in first)  # it trained


# ------------------------------------------------------------------------------------------------ examples --
@pytest.mark.parametrize("script, needs", [("hf_trainer.py", "transformers"), ("lightning_module.py", "lightning"),
                                           ("torch_compile.py", "torch._inductor")])
def test_example_runs(script, needs):
    pytest.importorskip(needs)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, str(REPO / "examples" / script), "--steps", "4"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "same parameters as torch.optim.AdamW" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("script, needs, says", [
    ("hf_trainer.py", "transformers", "same parameters as torch.optim.AdamW"),
    ("torchtitan_optimizer.py", "torchtitan", "same parameters as torch.optim.AdamW after 4 steps, and after a DCP"),
    ("accelerate_fsdp2.py", "accelerate", "FSDP2 plugin on 2 x cpu: same parameters as torch.optim.AdamW and the same"),
])
def test_example_on_two_cpu_processes(script, needs, says):
    """The examples under ``torchrun`` with 2 processes (gloo): ``hf_trainer.py``, where the Trainer (DDP) moves the
    model with ``model.to(torch.device("cpu", 0))`` after the optimizer was built (a copy), and each rank still
    ends with AdamW's parameters; ``torchtitan_optimizer.py``, torchtitan's optimizer container building ours over
    FSDP2's parameters, equal to its AdamW, also across a DCP round trip of its state dict; ``accelerate_fsdp2.py``,
    accelerate's FSDP2 plugin sharding the model and switching ours to the shards in ``prepare``, then accelerate's
    loop (accumulation, clipping, a schedule), equal to AdamW's parameters and moments at each step."""
    _torchrun(script, needs, says, 2)


def test_torchtitan_example_on_a_2x2_mesh_with_tensor_parallelism():
    """``examples/torchtitan_optimizer.py --tp 2`` on 4 processes: torchtitan's container over a model parallelized
    as its recipes do (rowwise embedding, sequence-parallel norm, colwise and rowwise linears) and sharded on a
    (2, 2) mesh, equal to its AdamW; the container's DCP checkpoint resumed on a (1, 4) mesh, equal to AdamW's."""
    _torchrun("torchtitan_optimizer.py", "torchtitan", "on a (2, 2) mesh: same parameters as torch.optim.AdamW after 4 "
              "steps, and after a DCP round trip of the container's state dict resumed on a (1, 4) mesh", 4, "--tp", "2")


def _torchrun(script, needs, says, nproc, *args):
    """``examples/script`` under ``torchrun`` with ``nproc`` processes (gloo), ``--steps 4`` and ``args``: it exits 0
    and prints ``says`` (skipped without the package ``needs``)."""
    pytest.importorskip(needs)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(nproc), str(REPO / "examples" / script), "--steps", "4", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert says in result.stdout, result.stdout[-2000:]


# ------------------------------------------------------------------------ report: a model from its HF config --
def test_report_plans_a_model_from_a_local_hf_config(tmp_path, capsys):
    """`python -m zero_offload.report --model config.json`: the model is built on the meta device from its config
    (offline), and the plan counts exactly the parameters the real model has (tied embeddings once)."""
    transformers = pytest.importorskip("transformers")
    from zero_offload.report import main

    config = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=24, n_layer=2, n_head=2)
    config.save_pretrained(tmp_path)
    real = transformers.AutoModelForCausalLM.from_config(config)
    numel = sum(p.numel() for p in real.parameters())
    main(["--model", str(tmp_path / "config.json"), "--dtype", "bf16", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == numel and data["dtype"] == "bf16"
    assert data["per_rank"]["torch.optim.AdamW"]["gpu"]["params"] == 2 * numel
    main(["--model", str(tmp_path)])  # the folder works too
    assert f"GPT2LMHeadModel, {numel:,} parameters" in capsys.readouterr().out


def test_report_hub_id_without_network_is_a_clear_error(tmp_path):
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}  # an empty cache, no network
    result = subprocess.run([sys.executable, "-m", "zero_offload.report", "--model", "no-such-org/no-such-model"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "could not load a model config from 'no-such-org/no-such-model'" in result.stderr
    assert "a hub model id needs network access" in result.stderr

"""OffloadOptimizer with a model under ``torch.compile``: compile the model (before or after building the
optimizer, either works and neither recompiles), keep the optimizer step uncompiled (it is already one fused
kernel call per bucket).

Trains a small MLP language model on random tokens, on the CPU (inductor needs a C++ compiler), once with
``torch.optim.AdamW`` and once with ``OffloadOptimizer``, and checks the two end with the same weights.

    python examples/torch_compile.py --steps 20
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero_offload import OffloadOptimizer

VOCAB = 64


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128),
                         nn.Linear(128, VOCAB))


def train(model, opt, steps):
    compiled = torch.compile(model)  # here after the optimizer; compiling first works the same
    for step in range(steps):
        x = torch.randint(0, VOCAB, (16, 24), generator=torch.Generator().manual_seed(step))
        loss = F.cross_entropy(compiled(x).reshape(-1, VOCAB), x.roll(1, 1).reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return loss.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    ref = make_model()
    ref_loss = train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, foreach=False), args.steps)
    ours = make_model()
    loss = train(ours, OffloadOptimizer(ours.parameters(), lr=3e-3, weight_decay=0.1), args.steps)
    diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), ours.parameters()))
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(q, p)
    print(f"OffloadOptimizer with torch.compile: same parameters as torch.optim.AdamW after {args.steps} steps "
          f"(loss {loss:.4f} vs {ref_loss:.4f}, max abs difference {diff:.1e})")


if __name__ == "__main__":
    main()

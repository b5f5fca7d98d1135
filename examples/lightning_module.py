"""OffloadOptimizer in PyTorch Lightning: return it from ``configure_optimizers``, with a scheduler; gradient
clipping (``Trainer(gradient_clip_val=...)``) and checkpoints (``ModelCheckpoint``) work as with AdamW.

Trains a tiny next-token model on random tokens, on the CPU, once with ``torch.optim.AdamW`` and once with
``OffloadOptimizer``, and checks the two end with the same weights.

    pip install torch==2.13.0 -e ".[integrations]"
    python examples/lightning_module.py --steps 30
"""

import argparse
import tempfile

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from zero_offload import OffloadOptimizer

VOCAB = 64


class TinyLM(L.LightningModule):
    def __init__(self, optimizer_class, steps, **opt_kw):
        super().__init__()
        self.optimizer_class, self.steps, self.opt_kw = optimizer_class, steps, opt_kw
        self.net = nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128),
                                 nn.Linear(128, VOCAB))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = self.optimizer_class(self.parameters(), lr=3e-3, weight_decay=0.1, **self.opt_kw)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train(optimizer_class, steps, root, **opt_kw):
    torch.manual_seed(0)
    module = TinyLM(optimizer_class, steps, **opt_kw)
    x = torch.randint(0, VOCAB, (256, 24), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(1, 1)), batch_size=16)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, gradient_clip_val=1.0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(module, loader)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ref = train(torch.optim.AdamW, args.steps, tmp, foreach=False)
        ours = train(OffloadOptimizer, args.steps, tmp)
    diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), ours.parameters()))
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(q, p)
    print(f"OffloadOptimizer in a LightningModule: same parameters as torch.optim.AdamW after {args.steps} steps "
          f"(max abs difference {diff:.1e})")


if __name__ == "__main__":
    main()

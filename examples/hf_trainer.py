"""OffloadOptimizer in a Hugging Face ``transformers.Trainer``: pass it (and a scheduler) as ``optimizers=``.

Trains a tiny randomly initialised GPT-2 (built from a config: nothing downloaded) on random tokens, on the CPU,
once with ``torch.optim.AdamW`` and once with ``OffloadOptimizer``, and checks the two end with the same weights.

    pip install torch==2.13.0 -e ".[integrations]"
    python examples/hf_trainer.py --steps 20
"""

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_linear_schedule_with_warmup

from zero_offload import OffloadOptimizer


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=256, seq=32, vocab=128):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(optimizer_class, steps, out_dir, **opt_kw):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # on a GPU, .cuda() it before building the optimizer
    opt = optimizer_class(model.parameters(), lr=1e-3, weight_decay=0.1, **opt_kw)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=steps // 10, num_training_steps=steps)
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=8, use_cpu=True,
                             report_to="none", save_strategy="no", logging_steps=max(1, steps // 5), seed=0)
    Trainer(model=model, args=args, train_dataset=RandomTokens(), optimizers=(opt, sched)).train()
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ref = train(torch.optim.AdamW, args.steps, tmp, foreach=False)
        ours = train(OffloadOptimizer, args.steps, tmp)
    diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), ours.parameters()))
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(q, p)
    print(f"OffloadOptimizer under transformers.Trainer: same parameters as torch.optim.AdamW after {args.steps} "
          f"steps (max abs difference {diff:.1e})")


if __name__ == "__main__":
    main()

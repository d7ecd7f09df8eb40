#!/usr/bin/env python3
"""The reference model of `conveyor train`, built from torch.nn modules, trained the same way.

token embedding -> L x [LayerNorm -> Linear d->h -> GELU(tanh) -> Linear h->d, + residual]
-> LayerNorm -> Linear d->V -> softmax cross-entropy; AdamW with clipping by the global norm;
the step's tokens split into micro-batches whose gradients accumulate. Prints one JSON line
with the measured tokens/s (median over timed steps after warm-up), so that
bench/compare_torch.py can put it beside Conveyor's figure from the same machine and run.

Thread counts: torch.set_num_threads sets PyTorch's intra-op pool; OpenBLAS has its own pool,
reached only through OPENBLAS_NUM_THREADS, which must be set before torch is imported (the
driver does it).
"""
import argparse
import json
import statistics
import time

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(d, eps=1e-5)
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class Reference(nn.Module):
    def __init__(self, d, layers, vocab, hidden):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d, hidden) for _ in range(layers)])
        self.ln = nn.LayerNorm(d, eps=1e-5)
        self.proj = nn.Linear(d, vocab)

    def forward(self, tokens, targets):
        h = self.blocks(self.embed(tokens))
        logits = self.proj(self.ln(h))
        return nn.functional.cross_entropy(logits, targets, reduction="sum")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=0, help="default 4 x d-model")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    for name in ("d_model", "layers", "vocab", "batch_tokens", "microbatches", "steps", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.hidden < 0:
        ap.error("--warmup and --hidden must not be negative")
    if args.batch_tokens % args.microbatches:
        ap.error("--batch-tokens must be a multiple of --microbatches")
    hidden = args.hidden or 4 * args.d_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = Reference(args.d_model, args.layers, args.vocab, hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    n = args.batch_tokens // args.microbatches
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, args.vocab, (args.microbatches, n + 1), generator=gen)
    scale = 1.0 / args.batch_tokens

    def step():
        opt.zero_grad(set_to_none=False)
        loss_sum = 0.0
        for k in range(args.microbatches):
            loss = model(data[k, :-1], data[k, 1:])
            (loss * scale).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss_sum * scale

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    print(json.dumps({
        "engine": "pytorch", "version": torch.__version__, "threads": args.threads,
        "blas": torch.__config__.show().count("OpenBLAS") and "OpenBLAS" or "other",
        "tokens_per_s": args.batch_tokens / median, "median_step_s": median,
        "steps": args.steps,
    }))


if __name__ == "__main__":
    main()

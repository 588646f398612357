"""Generation throughput on the demo policy: the generate stage's sampler (per-sample seeds, length-bucketed
micro-batches) against the same without bucketing, plain `generate` on padded batches in prompt order (what a
naive loop does), and one prompt at a time. Response tokens/s, medians over --trials.

    .venv/bin/python bench/bench_generation.py [--prompts 256] [--trials 3] [--append]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from rlaif.config import load_config
from rlaif.distributed import avoid_per_shape_attention_plans, clock
from rlaif.io.prompts import split
from rlaif.models.generation import encode_prompts, response_mask, sample
from rlaif.stages.generate import TransformersBackend, micro_batches, sample_seed

sys.path.insert(0, str(Path(__file__).parent))
from common import publish  # noqa: E402


def ours(backend, rows, texts, bucketing: bool) -> tuple[int, int]:
    """(response tokens, padded prompt positions) for 2 samples per prompt, as the stage samples them."""
    tokens = padded = 0
    lengths = backend.lengths(texts)
    for batch in micro_batches(lengths, 2, backend.g.batch_size, bucketing):
        jobs = [(i, j) for i in batch for j in range(2)]
        out = backend.sample([texts[i] for i, _ in jobs], [sample_seed(0, rows[i]["id"], j) for i, j in jobs])
        tokens += sum(n for _, n in out)
        padded += len(jobs) * max(lengths[i] for i in batch)
    return tokens, padded


def plain(backend, texts, prompts_per_batch: int) -> tuple[int, int]:
    tokens = padded = 0
    g, tok = backend.g, backend.tokenizer
    for b in range(0, len(texts), prompts_per_batch):
        enc = encode_prompts(tok, texts[b : b + prompts_per_batch], backend.device)
        out = sample(backend.model, tok, enc, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                     num_return_sequences=2, seed=b)
        tokens += int(response_mask(out, tok.eos_token_id).sum())
        padded += out.shape[0] * enc["input_ids"].shape[1]
    return tokens, padded


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--single", type=int, default=32, help="prompts for the one-at-a-time loop (it is slow)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    avoid_per_shape_attention_plans()  # as every stage does on a GPU
    cfg = load_config("configs/demo.yaml")
    backend = TransformersBackend(cfg)
    rows = split(cfg.data, "train")[: a.prompts]
    texts = backend.format([r["prompt"] for r in rows])
    per_batch = cfg.generate.batch_size // 2
    modes = {
        "rlaif generate: per-sample seeds, length buckets": (lambda: ours(backend, rows, texts, True), len(rows)),
        "rlaif generate without length buckets": (lambda: ours(backend, rows, texts, False), len(rows)),
        f"plain `generate`, padded batches of {per_batch} prompts": (lambda: plain(backend, texts, per_batch),
                                                                     len(rows)),
        "one prompt at a time": (lambda: plain(backend, texts[: a.single], 1), a.single),
    }
    ours(backend, rows[:8], texts[:8], True)  # warm-up
    results = {}
    for name, (fn, n_prompts) in modes.items():
        runs = []
        for _ in range(a.trials):
            torch.manual_seed(0)
            start = clock()
            tokens, padded = fn()
            runs.append((tokens / (clock() - start), padded / n_prompts / 2))
        results[name] = (statistics.median(r[0] for r in runs), runs[0][1], n_prompts)
        print(name, results[name], flush=True)
    base = results["one prompt at a time"][0]
    table = (f"| sampler (demo policy, {cfg.generate.batch_size} sequences per batch, "
             f"{cfg.generate.max_new_tokens} new tokens, 2 samples per prompt; {a.trials} trials) | prompts | "
             f"response tokens/s | padded prompt length | "
             f"vs one at a time |\n|---|---|---|---|---|\n")
    for name, (tps, pad, n) in results.items():
        table += f"| {name} | {n} | {tps:,.0f} | {pad:.1f} | {tps / base:.1f}x |\n"
    publish("Generation throughput", table, a.append)


if __name__ == "__main__":
    main()

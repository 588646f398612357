"""Generation throughput on the demo policy: the generate stage's sampler (per-sample seeds, length-bucketed
micro-batches) against the same without bucketing, plain `generate` on padded batches in prompt order (what a
naive loop does), one prompt at a time, and transformers' generate with the per-row sampler (the stage's sampler
before the static decoder). The stage's sampler is the static decoder (on a GPU with a CUDA graph, whose tokens are
checked against its eager steps', measured too). Response tokens/s, medians over --trials.

    .venv/bin/python bench/bench_generation.py [--prompts 256] [--trials 3] [--append] [--set KEY=VALUE]
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
from rlaif.models.decode import decode_static
from rlaif.models.generation import encode_prompts, response_mask, sample, sample_seeded, stop_ids
from rlaif.stages.generate import TransformersBackend, micro_batches, sample_seed

sys.path.insert(0, str(Path(__file__).parent))
from common import publish  # noqa: E402


def ours(backend, rows, texts, bucketing: bool, decoder: str = "auto") -> tuple[int, int]:
    """(response tokens, padded prompt positions) for 2 samples per prompt, as the stage samples them (`decoder`
    forces one; graph-less static decoding is `eager`)."""
    tokens = padded = 0
    lengths = backend.lengths(texts)
    for batch in micro_batches(lengths, 2, backend.g.batch_size, bucketing):
        jobs = [(i, j) for i in batch for j in range(2)]
        out = sampled(backend, [texts[i] for i, _ in jobs], [sample_seed(0, rows[i]["id"], j) for i, j in jobs],
                      decoder)
        tokens += int(response_mask(out, backend.tokenizer.eos_token_id).sum())
        padded += len(jobs) * max(lengths[i] for i in batch)
    return tokens, padded


def sampled(backend, texts, seeds, decoder: str):
    g, tok = backend.g, backend.tokenizer
    enc = encode_prompts(tok, texts, backend.device)
    if decoder == "eager":
        return decode_static(backend.model, enc, seeds, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                             top_k=g.top_k, top_p=g.top_p, eos_ids=stop_ids(tok), pad_id=tok.pad_token_id,
                             cuda_graph=False)
    return sample_seeded(backend.model, tok, enc, seeds, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                         top_p=g.top_p, top_k=g.top_k, decoder=decoder)


def graph_matches_eager(backend, rows, texts) -> str:
    """The CUDA graph replays the eager step's kernels: the same seeds give the same tokens (checked on 64 prompts)."""
    seeds = [sample_seed(0, row["id"], 0) for row in rows[:64]]
    graph = sampled(backend, texts[:64], seeds, "static")
    eager = sampled(backend, texts[:64], seeds, "eager")
    same = graph.shape == eager.shape and bool((graph == eager).all())
    return f"CUDA graph tokens equal the eager static decoder's on 64 prompts: {'yes' if same else 'NO'}"


def plain(backend, texts, prompts_per_batch: int) -> tuple[int, int]:
    tokens = padded = 0
    g, tok = backend.g, backend.tokenizer
    for b in range(0, len(texts), prompts_per_batch):
        enc = encode_prompts(tok, texts[b : b + prompts_per_batch], backend.device)
        # transformers' own generate() (sample() would take the static decoder on a GPU)
        out = sample(backend.model, tok, enc, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                     num_return_sequences=2, seed=b, decoder="generate")
        tokens += int(response_mask(out, tok.eos_token_id).sum())
        padded += out.shape[0] * enc["input_ids"].shape[1]
    return tokens, padded


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--single", type=int, default=32, help="prompts for the one-at-a-time loop (it is slow)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--append", action="store_true")
    p.add_argument("--set", action="append", default=[], help="config override, e.g. policy.tiny.hidden_size=512")
    a = p.parse_args()
    avoid_per_shape_attention_plans()  # as every stage does on a GPU
    cfg = load_config("configs/demo.yaml", a.set)
    backend = TransformersBackend(cfg)
    rows = split(cfg.data, "train")[: a.prompts]
    texts = backend.format([r["prompt"] for r in rows])
    per_batch = cfg.generate.batch_size // 2
    modes = {
        "rlaif generate: per-sample seeds, length buckets": (lambda: ours(backend, rows, texts, True), len(rows)),
        "rlaif generate without length buckets": (lambda: ours(backend, rows, texts, False), len(rows)),
    }
    if torch.cuda.is_available():
        modes["static decoder, eager steps (no CUDA graph), length buckets"] = (
            lambda: ours(backend, rows, texts, True, "eager"), len(rows))
    modes["transformers `generate` + per-row sampler (before), length buckets"] = (
        lambda: ours(backend, rows, texts, True, "generate"), len(rows))
    modes |= {
        f"plain `generate`, padded batches of {per_batch} prompts": (lambda: plain(backend, texts, per_batch),
                                                                     len(rows)),
        "one prompt at a time": (lambda: plain(backend, texts[: a.single], 1), a.single),
    }
    ours(backend, rows[:8], texts[:8], True)  # warm-up
    check = graph_matches_eager(backend, rows, texts) if torch.cuda.is_available() else ""
    print(check, flush=True)
    runs = {name: [] for name in modes}
    for _ in range(a.trials):  # trials alternate between the samplers, so drift in the machine hits all alike
        for name, (fn, n_prompts) in modes.items():
            torch.manual_seed(0)
            start = clock()
            tokens, padded = fn()
            runs[name].append((tokens / (clock() - start), padded / n_prompts / 2))
    results = {}
    for name, (_, n_prompts) in modes.items():
        speeds = [r[0] for r in runs[name]]
        results[name] = (statistics.median(speeds), runs[name][0][1], n_prompts, min(speeds), max(speeds))
        print(name, results[name], flush=True)
    base = results["one prompt at a time"][0]
    table = (f"| sampler (demo policy, {cfg.generate.batch_size} sequences per batch, "
             f"{cfg.generate.max_new_tokens} new tokens, 2 samples per prompt; {a.trials} trials) | prompts | "
             f"response tokens/s (median) | range | padded prompt length | "
             f"vs one at a time |\n|---|---|---|---|---|---|\n")
    for name, (tps, pad, n, low, high) in results.items():
        table += f"| {name} | {n} | {tps:,.0f} | {low:,.0f}-{high:,.0f} | {pad:.1f} | {tps / base:.1f}x |\n"
    policy = cfg.policy.tiny
    size = f", policy h{policy.hidden_size}x{policy.num_layers}" if a.set else ""
    publish(f"Generation throughput{size}", table + (f"\n{check}\n" if check else ""), a.append)


if __name__ == "__main__":
    main()

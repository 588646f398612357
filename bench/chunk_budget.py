"""PPO phase times and peak RSS against the chunked log-probs' chunk budget (rlaif/algo/logprobs.py CHUNK_ELEMENTS),
on bench_ppo's h256x4v32k policy (a 32k-token output layer, LoRA r16 or all weights trained, fixed-length responses):
the stage's rollout() and update(), each budget in its own process, one warm-up iteration then the median of
--iterations.

    .venv/bin/python bench/chunk_budget.py [--iterations 2] [--lora-rank 16] [--append]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_ppo import (  # noqa: E402
    EPOCHS,
    MINIBATCH,
    RESPONSE_LEN,
    ROLLOUT,
    bench_overrides,
    import_our_libraries,
    ours_setup,
    shared_models,
)
from bench_ppo_scaling import PHASES, phase_medians  # noqa: E402
from common import mark_import_baseline, publish, report_result, side_by_side  # noqa: E402

SIZE, BUDGETS = "h256x4v32k", (2**25, 2**24, 2**23, 2**22, 2**21)


def worker(work: Path, budget: int, iterations: int, lora_rank: int) -> dict:
    from rlaif.algo import logprobs

    options = argparse.Namespace(rollout=ROLLOUT, minibatch=MINIBATCH, epochs=EPOCHS, response_length=RESPONSE_LEN,
                                 lora_rank=lora_rank, fixed_length=True, rollout_logprobs="auto", reward_inputs="auto")
    import_our_libraries(options)
    mark_import_baseline()
    logprobs.CHUNK_ELEMENTS = budget
    policy_dir, rm_dir = shared_models(work, SIZE)
    cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp = ours_setup(
        [*bench_overrides(options), f"policy.model={policy_dir}"], rm_dir)
    result = phase_medians(cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp, iterations)
    return {**result, "chunk_tokens": logprobs.chunk_tokens(policy.lm.config.vocab_size)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--worker", type=int)
    p.add_argument("--work", default="runs")
    p.add_argument("--lora-rank", type=int, default=16, help="0: all weights trained (the output layer's gradient too)")
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    if a.worker:
        report_result(worker(Path(a.work), a.worker, a.iterations, a.lora_rank))
        return
    shared_models(Path(a.work), SIZE)
    results = side_by_side(__file__, tuple(str(b) for b in BUDGETS), 1, ["--work", a.work, "--iterations",
                                                                         str(a.iterations), "--lora-rank",
                                                                         str(a.lora_rank)],
                           (*PHASES, "chunk_tokens"))
    lines = ["| chunk budget (fp32 logits) | tokens per chunk | generate s | score s | reference s | update s | "
             "peak RSS above the import baseline (MiB) |", "|---|---|---|---|---|---|---|"]
    for budget in BUDGETS:
        r = results[str(budget)]
        lines.append(f"| {budget * 4 / 2**20:.0f} MiB | {r['chunk_tokens']:.0f} | "
                     + " | ".join(f"{r[k]:.2f}" for k in PHASES) + f" | {r['rss_above_baseline_mib']:.0f} |")
    weights = f"LoRA r{a.lora_rank}" if a.lora_rank else "all weights"
    publish(f"Chunked log-probs: chunk budget on a CPU (policy {SIZE}, {weights}, fixed-length responses, median of "
            f"{a.iterations} iterations after a warm-up, one process per budget)", "\n".join(lines), a.append)


if __name__ == "__main__":
    main()

"""PPO / GRPO iteration phase by phase under glibc's default malloc, which hands large freed blocks back to the system
so the next step's activations page-fault in again, and with freed memory kept in the process (mallopt: blocks up to
1 GiB from the heap, the heap never trimmed; an experiment, not what the stages do: BENCHMARKS.md, session 32). A
malloc setting lasts for a process's life, so each round runs one worker process per mode, alternating; medians of
the rounds (each worker's first iteration untimed). The workload is
bench_ppo.py's (16 prompts x 4 samples for GRPO, 64 prompts for PPO; minibatches of 16, 2 passes, fixed-length
responses of 48 tokens).

    .venv/bin/python bench/bench_freed_memory.py [--algorithm grpo|ppo] [--size h256x4] [--lora-rank 16]
        [--rounds 4] [--iterations 3] [--append]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_grpo import GROUP, GRPO_OVERRIDES, KL  # noqa: E402
from bench_ppo import OVERRIDES, ROLLOUT, SIZES, ours_setup, shared_models  # noqa: E402
from common import peak_rss_mib, publish  # noqa: E402

from rlaif.distributed import clock  # noqa: E402

PHASES = ("generate_s", "score_s", "reference_s", "update_s", "iteration_s", "page_faults")
MODES = {"release": "glibc's default", "keep": "freed memory kept"}


def keep_freed_memory() -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    trim_threshold, mmap_threshold = -1, -3  # malloc.h's M_TRIM_THRESHOLD and M_MMAP_THRESHOLD
    # The trim setting alone would pin the mmap threshold at its 128 KiB start (no adaptation): set both or neither.
    if not (libc.mallopt(mmap_threshold, 1 << 30) and libc.mallopt(trim_threshold, 2**31 - 1)):
        sys.exit("glibc refused the malloc settings")


def worker(a) -> dict:
    """One process: `a.iterations` timed iterations after a warm-up; per-phase medians and minor page faults."""
    from rlaif.io.prompts import split
    from rlaif.stages import ppo

    if a.worker == "keep":
        keep_freed_memory()
    grpo = a.algorithm == "grpo"
    policy_dir, rm_dir = shared_models(Path("runs"), a.size)
    cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp = ours_setup(
        [*OVERRIDES, f"ppo.lora_rank={a.lora_rank}", "ppo.fixed_length=true", f"policy.model={policy_dir}",
         *(GRPO_OVERRIDES if grpo else [])], rm_dir)
    prompts = split(cfg.data, "train")[: ROLLOUT // (GROUP if grpo else 1)]
    seconds: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for it in range(a.iterations + 1):
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, clock()
        batch, _, timings = ppo.rollout(cfg, policy, reference_logprobs, tokenizer, reward_fn, prompts, seed=it,
                                        device=device, kl_coef=KL, amp=amp)
        update_start = clock()
        ppo.update(cfg, engine, ppo.whiten_advantages(cfg, batch), seed=it, kl_coef=KL, amp=amp)
        timings.update(update_s=clock() - update_start, iteration_s=clock() - start,
                       page_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        for phase in PHASES if it else ():
            seconds[phase].append(timings[phase])
    return {**{phase: statistics.median(values) for phase, values in seconds.items()}, "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algorithm", default="grpo", choices=["grpo", "ppo"])
    p.add_argument("--size", default="h256x4", choices=sorted(SIZES))
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--append", action="store_true")
    p.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a)), flush=True)
        return
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_ in range(a.rounds):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--worker", mode, *sys.argv[1:]], capture_output=True,
                                 text=True)
            line = [text for text in out.stdout.splitlines() if text.startswith("RESULT ")]
            if not line:
                sys.exit(f"{mode} failed:\n{out.stderr[-4000:]}")
            results[mode].append(json.loads(line[0][7:]))
            print(f"round {round_ + 1} {mode}: {results[mode][-1]}", flush=True)
    release, keep = MODES.values()
    lines = [f"| phase | {release} | {keep} | {keep} / {release} |", "|---|---|---|---|"]
    for phase in (*PHASES, "peak_rss_mib"):
        before, after = (statistics.median(r[phase] for r in results[mode]) for mode in MODES)
        name = {"page_faults": "minor page faults per iteration", "peak_rss_mib": "peak RSS (MiB)"}.get(
            phase, phase.removesuffix("_s") + " s")
        number = "{:.0f}" if phase in ("page_faults", "peak_rss_mib") else "{:.3f}"
        lines.append(f"| {name} | {number.format(before)} | {number.format(after)} | "
                     f"{after / before if before else float('nan'):.2f} |")
    weights = f"LoRA r{a.lora_rank}" if a.lora_rank else "all weights"
    title = (f"{a.algorithm.upper()} phases, glibc's default malloc vs freed memory kept, policy {a.size}, {weights}, "
             f"fixed-length responses, medians of {a.rounds} alternating worker pairs of {a.iterations} iterations")
    publish(title, "\n".join(lines) + "\n", a.append)


if __name__ == "__main__":
    main()

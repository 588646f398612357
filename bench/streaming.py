"""Streaming label: wall clock of generate then label, one after the other (what `rlaif run` does by default), against
the two at once with label.streaming (what `rlaif run` does with it: two `rlaif launch` processes, label following
generate's shards as they land). Config: the demo's (the built-in tiny policy, 922 training prompts, 72-token
answers; label's MiniLM embedding judge with every principle), with generate.shard_size 64 so label can start after
generate's first 64 pairs. Each trial runs in a fresh storage root (no cache hits); the policy is built before the
first. Both ways must commit the same label manifest digest.

    .venv/bin/python bench/streaming.py [--trials 3] [--shard-size 64] [--append]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

from rlaif import runner
from rlaif.config import load_config
from rlaif.distributed import clock
from rlaif.io import manifest
from rlaif.orchestration import launch
from rlaif.stages.common import stage_url

sys.path.insert(0, str(Path(__file__).parent))
from common import publish  # noqa: E402


def config(root: str, shard_size: int, streaming: bool, *extra: str):
    return load_config("configs/demo.yaml", [f"storage.root=file://{root}", f"generate.shard_size={shard_size}",
                                             f"label.streaming={str(streaming).lower()}", *extra])


def children_cpu_s() -> float:
    """CPU seconds of every finished child process so far (their own children included once waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def trial(shard_size: int, streaming: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlaif-bench-stream-") as root:
        cfg = config(root, shard_size, streaming)
        config_url = launch.prepare(cfg)
        cpu, start = children_cpu_s(), clock()
        if streaming:
            runner.launch_together(["generate", "label"], config_url)
            times = {"streaming": clock() - start}
        else:
            launch.launch(cfg, "generate", config_url)
            middle = clock()
            launch.launch(cfg, "label", config_url)
            times = {"generate": middle - start, "label": clock() - middle}
            times.update(sequential=clock() - start, overlap_bound=max(times["generate"], times["label"]))
        times["cpu_bound"] = (children_cpu_s() - cpu) / (os.cpu_count() or 1)
        return {**times, "digest": manifest.require(stage_url(cfg, "label"), "label")["digest"]}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} | {min(values):.1f} to {max(values):.1f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:  # builds the tiny policy into the model cache if it is not there
        warm = config(root, a.shard_size, False, "generate.max_prompts=8")
        launch.launch(warm, "generate", launch.prepare(warm))
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for number in range(a.trials):
        for streaming in (False, True):  # interleaved: drifts of the machine hit both ways alike
            runs[streaming].append(trial(a.shard_size, streaming))
            print(f"trial {number + 1} {'streaming' if streaming else 'sequential'}: {runs[streaming][-1]}", flush=True)
    digests = {r["digest"] for rs in runs.values() for r in rs}
    if len(digests) != 1:
        sys.exit(f"label manifests differ between runs: {sorted(digests)}")
    seq, stream = runs[False], runs[True]
    saved = [1 - s["streaming"] / q["sequential"] for q, s in zip(seq, stream)]
    table = "\n".join([
        "| wall clock (s) | median | range |", "|---|---|---|",
        f"| generate alone (sequential run) | {spread([r['generate'] for r in seq])} |",
        f"| label alone (sequential run) | {spread([r['label'] for r in seq])} |",
        f"| generate then label (sequential total) | {spread([r['sequential'] for r in seq])} |",
        f"| max(generate, label): the bound for full overlap | {spread([r['overlap_bound'] for r in seq])} |",
        f"| CPU time of both stages' processes / cores: the bound here (sequential run) | "
        f"{spread([r['cpu_bound'] for r in seq])} |",
        f"| both at once, label streaming (streaming total) | {spread([r['streaming'] for r in stream])} |",
        f"| CPU time / cores (streaming run) | {spread([r['cpu_bound'] for r in stream])} |",
        f"| streaming total vs sequential total, per trial pair | {statistics.median(saved):.0%} less | "
        f"{min(saved):.0%} to {max(saved):.0%} |",
        "", f"Same label manifest digest in all {2 * a.trials} runs: `{digests.pop()[:16]}`."])
    publish(f"Streaming label vs generate then label (demo config, generate.shard_size={a.shard_size}; median of "
            f"{a.trials} trials)", table, a.append)


if __name__ == "__main__":
    main()

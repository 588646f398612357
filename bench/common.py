"""What the benchmarks share: side-by-side worker processes (each its own peak RSS), medians, and appending a dated,
machine-described table to BENCHMARKS.md."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from rlaif.phases import RL_PHASES, peak_gpu_mib, peak_rss_mib  # the PPO stage restarts the marks per phase

_baseline_rss_mib: float | None = None


def mark_import_baseline() -> None:
    """Called by a worker once its imports are done, before it builds anything: the RSS that the runtime and the
    libraries cost, which the peak above it excludes (the trainers import different libraries)."""
    global _baseline_rss_mib
    _baseline_rss_mib = peak_rss_mib()


def report_result(result: dict) -> None:
    """Called at the end of a worker process: its result plus its own peak RSS (and the peak above its import
    baseline, when marked), on one parseable line."""
    result["peak_rss_mib"] = peak_rss_mib()
    phase_peaks = result.pop("phase_rss_mib", {})  # {phase: its peak RSS in the first iteration}
    if _baseline_rss_mib is not None:
        result["rss_above_baseline_mib"] = result["peak_rss_mib"] - _baseline_rss_mib
        result.update({f"{name}_above_baseline_mib": mib - _baseline_rss_mib for name, mib in phase_peaks.items()})
    if torch.cuda.is_available():
        result["peak_gpu_mib"] = peak_gpu_mib()
    print("RESULT " + json.dumps(result), flush=True)


def side_by_side(script: str, workers: tuple[str, ...], trials: int, args: list[str], keys: tuple[str, ...],
                 before_each: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
    """Runs `script --worker NAME ARGS` for every worker in every trial, interleaved; returns medians per worker."""
    results: dict[str, list[dict]] = {w: [] for w in workers}
    for trial in range(trials):
        for who in workers:
            if before_each:
                before_each(who)
            out = subprocess.run([sys.executable, script, "--worker", who, *args], capture_output=True, text=True,
                                 env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count())))
            line = [text for text in out.stdout.splitlines() if text.startswith("RESULT ")]
            if not line:
                sys.exit(f"{who} failed:\n{out.stderr[-4000:]}")
            results[who].append(json.loads(line[0][7:]))
            print(f"trial {trial + 1} {who}: {results[who][-1]}", flush=True)
    medians = {w: {k: statistics.median(r[k] for r in rs) for k in (*keys, *MEMORY_KEYS) if k in rs[0]}
               for w, rs in results.items()}
    for w, rs in results.items():  # the spread of each median, for the tables
        medians[w]["range"] = {k: f"{short(min(r[k] for r in rs))}-{short(max(r[k] for r in rs))}"
                               for k in (*keys, *MEMORY_KEYS) if k in rs[0]}
    return medians


MEMORY_KEYS = ("peak_rss_mib", "rss_above_baseline_mib", "peak_gpu_mib",
               *(f"{name}_above_baseline_mib" for name in RL_PHASES))


def short(x: float) -> str:
    """Three significant digits, without exponents (1,392 MiB reads as 1392, not 1.39e+03)."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def peak_memory_key() -> tuple[str, str]:
    """The memory that bounds a run here: GPU memory allocated on a GPU machine, process RSS on a CPU one."""
    return (("peak_gpu_mib", "peak GPU allocated (MiB)") if torch.cuda.is_available()
            else ("peak_rss_mib", "peak RSS (MiB)"))



def machine(extra: str = "") -> str:
    gpu = f"{torch.cuda.get_device_name()}, " if torch.cuda.is_available() else ""
    return (f"{gpu}{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}"
            + (f", {extra}" if extra else ""))


def timed(fn: Callable[[], object], trials: int) -> float:
    """Median wall seconds of fn over trials (GPU work synchronised)."""
    from rlaif.distributed import clock

    times = []
    for _ in range(trials):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def compare_iterations(script: str, a, prepare: Callable[[], None], title: str, ours: str, peer: str,
                       passed: list[str] = ()) -> None:
    """Side-by-side RL iterations/s and peak memory of workers 'ours' and 'trl' (medians), appended to BENCHMARKS.md."""
    from pathlib import Path

    Path(a.work).mkdir(exist_ok=True)
    prepare()
    med = side_by_side(script, ("ours", "trl"), a.trials,
                       ["--work", a.work, "--iterations", str(a.iterations), "--size", a.size, *passed],
                       ("iterations_per_s", "samples_per_s"))
    o, t = med["ours"], med["trl"]
    mem, mem_title = peak_memory_key()
    above = mem == "peak_rss_mib" and "rss_above_baseline_mib" in o
    extra_title, extra_rule = (" | peak RSS above the import baseline (MiB)", "|---") if above else ("", "")

    def row(name: str, r: dict) -> str:
        speed = f"{r['iterations_per_s']:.3f} ({r['range']['iterations_per_s']})" if "range" in r else \
            f"{r['iterations_per_s']:.3f}"
        return (f"| {name} | {speed} | {r['samples_per_s']:.1f} | {r[mem]:.0f}"
                + (f" | {r['rss_above_baseline_mib']:.0f} ({r['range']['rss_above_baseline_mib']})" if above else "")
                + " |")

    ratio = (f"| ratio (rlaif / TRL) | {o['iterations_per_s'] / t['iterations_per_s']:.2f}x | | "
             f"{o[mem] / t[mem]:.2f}x" + (f" | {o['rss_above_baseline_mib'] / t['rss_above_baseline_mib']:.2f}x"
                                          if above else "") + " |")
    by_phase = [f"{name} {o[key]:.0f} ({o['range'][key]})" for name in RL_PHASES
                if (key := f"{name}_above_baseline_mib") in o]
    append(title, "\n".join([f"| trainer | iterations/s (range) | samples/s | {mem_title}{extra_title} |",
                             f"|---|---|---|---{extra_rule}|", row(ours, o), row(peer, t), ratio]
                            + ([f"\n{ours}'s peak RSS above the import baseline by phase in its first iteration, "
                                f"MiB (range): {', '.join(by_phase)}"] if by_phase else [])))


def publish(title: str, table: str, to_benchmarks: bool) -> None:
    """Prints the table; with --append, also adds it to BENCHMARKS.md under a dated heading."""
    if to_benchmarks:
        append(title, table)
    else:
        print(table)


def append(title: str, table: str) -> None:
    """Prints the table and appends it to BENCHMARKS.md under a dated heading."""
    text = f"\n### {title} ({time.strftime('%Y-%m-%d')}; {machine()})\n\n{table.rstrip()}\n"
    print(text)
    with open("BENCHMARKS.md", "a") as f:
        f.write(text)

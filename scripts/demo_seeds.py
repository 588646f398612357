"""Runs the embedded demo on several seeds and records the results: docs/demo_results.json (every number with the
date, command, machine and commit of its run), the seed table in BENCHMARKS.md and the demo block in README.md.

    python scripts/demo_seeds.py --seeds 0 1 2          # `make demo-seeds`
    python scripts/demo_seeds.py --render-only          # rewrite the Markdown from docs/demo_results.json

Seed 0 is `make demo` itself (run id `demo`), so its run is the one README quotes. tests/unit/test_demo_results.py
fails when README.md or BENCHMARKS.md disagree with docs/demo_results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "demo_results.json"
CONFIG = "configs/demo.yaml"
START, END = "<!-- demo-results:start (scripts/demo_seeds.py writes this block) -->", "<!-- demo-results:end -->"


def run_id(seed: int) -> str:
    return "demo" if seed == 0 else f"demo-seed{seed}"


def machine() -> str:
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, no GPU"
            if not torch.cuda.is_available() else f"{torch.cuda.get_device_name()}, torch {torch.__version__}")


def run_seed(seed: int, rlaif: str) -> dict:
    """One demo run (cache hits where it already ran), then its headline numbers from the run's own files."""
    command = [rlaif, "run", "--config", CONFIG, "--set", f"seed={seed}", "--set", f"run_id={run_id(seed)}"]
    start = time.time()
    subprocess.run(command, cwd=REPO, check=True)
    seconds = time.time() - start
    base = REPO / "runs" / run_id(seed)
    metrics = json.loads((base / "evaluate" / "metrics.json").read_text())
    label = json.loads((base / "label" / "metrics.json").read_text())
    rm = json.loads((base / "train_rm" / "manifest.json").read_text())["summary"]
    judges = {name: {"win_rate": j["win_rate"], "ci95": j["win_rate_ci95"]} for name, j in metrics["judges"].items()}
    return {"seed": seed, "run_id": run_id(seed), "command": " ".join(["rlaif", *command[1:]]),
            "seconds": round(seconds), "n_prompts": metrics["n_prompts"], "judges": judges,
            "kl": metrics["kl_to_reference"],
            "top_response_share": metrics["diversity"]["top_response_share"],
            "distinct_2": metrics["diversity"]["distinct_2"], "eos_rate": metrics["eos_rate_policy"],
            "label_reference_agreement": label["reference_agreement"],
            "rm_held_out_accuracy": rm["held_out_accuracy"],
            "rm_held_out_reference_accuracy": rm["held_out_reference_accuracy"]}


def _wr(run: dict, judge: str) -> str:
    j = run["judges"][judge]
    return f"{j['win_rate']:.3f} [{j['ci95'][0]:.3f}, {j['ci95'][1]:.3f}]"


def table(results: dict) -> str:
    """The per-seed table (BENCHMARKS.md)."""
    head = ("| seed | reference judge (ground truth) | training judge | held-out judge | most common answer | "
            "labeler vs reference | RM accuracy: labels / reference | KL | seconds |\n"
            "|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['seed']} | {_wr(r, 'reference')} | {_wr(r, 'training')} | {_wr(r, 'heldout')} | "
            f"{r['top_response_share']:.3f} | {r['label_reference_agreement']:.3f} | {r['rm_held_out_accuracy']:.3f} / "
            f"{r['rm_held_out_reference_accuracy']:.3f} | {r['kl']:.2f} | {r['seconds']} |" for r in results["runs"]]
    return (f"{START}\nMeasured {results['date']} on {results['machine']}, commit {results['commit']}: "
            f"`make demo-seeds` (each row: `rlaif run --config {CONFIG} --set seed=S --set run_id=demo-seedS`, run id "
            f"`demo` for seed 0; win rates over {results['runs'][0]['n_prompts']} held-out prompts with 95% intervals; "
            "seed 0's seconds include the one-time tiny-policy build).\n\n"
            + "\n".join([head, *rows]) + f"\n{END}")


def readme_block(results: dict) -> str:
    """What README says about the demo: one run (seed 0, the `make demo` run), with its date and command."""
    run = next(r for r in results["runs"] if r["seed"] == 0)
    others = [r for r in results["runs"] if r["seed"] != 0]
    spread = ", ".join(f"seed {r['seed']}: {r['judges']['reference']['win_rate']:.3f}" for r in others)
    return (f"{START}\n`make demo` on {results['date']} ({results['machine']}, commit {results['commit']}, "
            f"`{run['command']}`, {run['seconds']} s; win rates over {run['n_prompts']} held-out prompts with 95% "
            f"intervals):\n\n| what the demo measures | result |\n|---|---|\n"
            f"| tuned vs starting policy, reference judge (key points covered; never trained against) | "
            f"{_wr(run, 'reference')} |\n"
            f"| tuned vs starting policy, training judge (the AI labeler) | {_wr(run, 'training')} |\n"
            f"| tuned vs starting policy, held-out AI judge (other principles) | {_wr(run, 'heldout')} |\n"
            f"| share of the most common tuned answer (mode collapse above 0.05) | {run['top_response_share']:.3f} |\n"
            f"| AI labeler agrees with the reference judge (pairs where it has a clear preference) | "
            f"{run['label_reference_agreement']:.3f} |\n"
            f"| reward model, held-out accuracy against the AI labels / the reference judge | "
            f"{run['rm_held_out_accuracy']:.3f} / {run['rm_held_out_reference_accuracy']:.3f} |\n"
            + (f"\nOther seeds (`make demo-seeds`), reference judge: {spread}.\n" if others else "") + END)


def replace_block(path: Path, block: str) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no demo-results block to replace")
    path.write_text(pattern.sub(lambda _: block, text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--render-only", action="store_true", help="rewrite README/BENCHMARKS from the results file")
    args = parser.parse_args()
    if not args.render_only:
        rlaif = str(Path(sys.executable).with_name("rlaif"))
        runs = [run_seed(seed, rlaif) for seed in args.seeds]
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit, "runs": runs}
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    results = json.loads(RESULTS.read_text())
    replace_block(REPO / "BENCHMARKS.md", table(results))
    replace_block(REPO / "README.md", readme_block(results))
    print(table(results))


if __name__ == "__main__":
    main()

"""Reward-model distillation on the demo (issue 21): the student's agreement with the teacher, PPO's reward-scoring
time with the student against the teacher, and the demo's win rates with each. Per seed: one pipeline run with
train_rm.student.layers set and PPO on the teacher, then PPO and evaluate again on the student (generate, label and
train_rm are cache hits). Both PPO runs use the same teacher, so the teacher row is the demo's own run.

    .venv/bin/python bench/bench_distill.py [--seeds 0] [--layers 1] [--append]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import publish  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def run(seed: int, layers: int, reward_model: str, root: Path) -> dict:
    run_id = f"distill-seed{seed}-l{layers}"
    command = [sys.executable, "-m", "rlaif", "run", "--config", "configs/demo.yaml", "--storage-root",
               f"file://{root}", "--set", f"seed={seed}", "--set", f"run_id={run_id}",
               "--set", f"train_rm.student.layers={layers}", "--set", f"ppo.reward_model={reward_model}"]
    subprocess.run(command, cwd=REPO, check=True)
    base = root / run_id
    rm = json.loads((base / "train_rm" / "manifest.json").read_text())["summary"]
    ppo = json.loads((base / "ppo" / "manifest.json").read_text())["summary"]
    metrics = json.loads((base / "evaluate" / "metrics.json").read_text())
    return {"seed": seed, "layers": layers, "reward_model": reward_model, "student": rm["student"],
            "teacher_accuracy": rm["held_out_accuracy"],
            "score_s": ppo["phase_seconds"]["score_s"] / ppo["iterations"],
            "iteration_s": ppo["seconds_per_iteration"], "kl": metrics["kl_to_reference"],
            "win_rates": {name: j["win_rate"] for name, j in metrics["judges"].items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--layers", type=int, nargs="+", default=[1])
    p.add_argument("--root", default=str(REPO / "runs" / "bench-distill"))
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    rows = [run(seed, layers, model, Path(a.root)) for seed in a.seeds for layers in a.layers
            for model in ("teacher", "student")]
    for row in rows:
        print(json.dumps(row), flush=True)
    lines = ["| seed | student layers (params) | PPO scores with | score s / iteration | PPO s / iteration | "
             "student-teacher pairwise agreement (held-out pairs) | Pearson / Spearman | RM accuracy vs AI labels: "
             "student / teacher | win rate: reference / training / held-out judge | KL |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, w = r["student"], r["win_rates"]
        size = f"{s['parameters'] / 1e6:.1f}M of {s['teacher_parameters'] / 1e6:.1f}M"
        lines.append(f"| {r['seed']} | {r['layers']} ({size}) | {r['reward_model']} | {r['score_s']:.3f} | "
                     f"{r['iteration_s']:.2f} | "
                     f"{s['pairwise_agreement']:.3f} ({s['held_out_pairs']}) | {s['pearson']:.3f} / "
                     f"{s['spearman']:.3f} | {s['held_out_accuracy']:.3f} / {r['teacher_accuracy']:.3f} | "
                     f"{w['reference']:.3f} / {w['training']:.3f} / {w['heldout']:.3f} | {r['kl']:.2f} |")
    publish("Reward-model distillation on the demo (train_rm.student)", "\n".join(lines) + "\n", a.append)


if __name__ == "__main__":
    main()

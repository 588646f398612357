"""Reward-model training throughput and peak memory: rlaif's train_rm against TRL's RewardTrainer.

Same backbone (MiniLM-L6), same labels (the first label shard of a finished run, hard-oriented for TRL, which has
no soft labels), same tokenized (prompt, response) inputs, batch size, max length, one process each with the same
threads, no checkpoints. Each trainer runs in its own process, so peak RSS is its own. Medians over --trials.

    .venv-bench/bin/python bench/bench_reward_model.py --source-run runs/demo --trials 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH, MAX_LEN, LR = 16, 128, 1e-4


def labels_subset(source_run: Path, work: Path) -> Path:
    """A run directory whose label stage is the source run's first label shard (with its own manifest)."""
    src = json.loads((source_run / "label" / "manifest.json").read_text())
    run = work / "bench-rm"
    if run.exists():
        shutil.rmtree(run)
    (run / "label").mkdir(parents=True)
    shard = src["shards"][0]
    shutil.copy(source_run / "label" / shard["url"], run / "label" / shard["url"])
    from rlaif.io import manifest, storage

    storage.configure(None)
    manifest.write(storage.normalize(str(run / "label")), stage="label", run_id="bench-rm", config_hash="bench",
                   inputs={}, shards=[shard])
    return run


def worker_ours(run: Path) -> dict:
    from rlaif.config import load_config
    from rlaif.runner import run_stage

    cfg = load_config("configs/demo.yaml", [f"storage.root={run.parent}", "run_id=bench-rm", f"train_rm.batch_size={BATCH}",
                                            f"train_rm.max_length={MAX_LEN}", f"train_rm.lr={LR}", "train_rm.checkpoint_every=0"])
    run_stage(cfg, "train_rm")
    summary = json.loads((run / "train_rm" / "manifest.json").read_text())["summary"]
    return {"pairs_per_s": summary["samples_per_s"], "steps": summary["steps"]}


def worker_trl(run: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from rlaif.io import manifest as mf
    from rlaif.io import storage
    from rlaif.io.shards import read_all
    from rlaif.models.loading import minilm_dir
    from rlaif.stages.train_rm import held_out

    storage.configure(None)
    url = storage.normalize(str(run / "label"))
    samples = [s for s in read_all(url, mf.read(url)) if not held_out(s["__key__"], 0.1)]
    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    rows = {"chosen_ids": [], "rejected_ids": []}  # TRL 1.16's pre-tokenized columns (its collator pads and masks)
    for s in samples:
        a_wins = s["label.json"]["p_a"] >= 0.5
        chosen, rejected = (s["response_a.txt"], s["response_b.txt"]) if a_wins else (s["response_b.txt"], s["response_a.txt"])
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            rows[f"{name}_ids"].append(tok(s["prompt.txt"], text, truncation=True, max_length=MAX_LEN)["input_ids"])
    model = AutoModelForSequenceClassification.from_pretrained(str(minilm_dir()), num_labels=1)
    args = RewardConfig(output_dir=str(run / "trl-out"), per_device_train_batch_size=BATCH, num_train_epochs=1,
                        learning_rate=LR, max_length=MAX_LEN, report_to=[], save_strategy="no", logging_steps=10**6,
                        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, bf16=False, fp16=False)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tok)
    out = trainer.train()
    return {"pairs_per_s": out.metrics["train_samples_per_second"], "steps": out.global_step}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source-run", default="runs/demo")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--worker", choices=["ours", "trl"])
    p.add_argument("--run")
    a = p.parse_args()
    if a.worker:
        result = (worker_ours if a.worker == "ours" else worker_trl)(Path(a.run))
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps(result))
        return
    import trl
    import torch

    run = labels_subset(Path(a.source_run), Path("runs"))
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for trial in range(a.trials):
        for who in ("ours", "trl"):
            if (run / "train_rm").exists():
                shutil.rmtree(run / "train_rm")
            out = subprocess.run([sys.executable, __file__, "--worker", who, "--run", str(run)], capture_output=True, text=True,
                                 env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count())))
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                sys.exit(f"{who} failed:\n{out.stderr[-3000:]}")
            results[who].append(json.loads(line[0][7:]))
            print(f"trial {trial + 1} {who}: {results[who][-1]}", flush=True)
    med = {who: {k: statistics.median(r[k] for r in rs) for k in ("pairs_per_s", "peak_rss_mib", "steps")} for who, rs in results.items()}
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, trl {trl.__version__}"
    table = [
        f"### Reward-model training vs TRL RewardTrainer ({time.strftime('%Y-%m-%d')}; {machine}; median of {a.trials})",
        "",
        "| trainer | pairs/s | peak RSS (MiB) | steps |",
        "|---|---|---|---|",
        f"| rlaif train_rm | {med['ours']['pairs_per_s']:.2f} | {med['ours']['peak_rss_mib']:.0f} | {med['ours']['steps']:.0f} |",
        f"| TRL RewardTrainer | {med['trl']['pairs_per_s']:.2f} | {med['trl']['peak_rss_mib']:.0f} | {med['trl']['steps']:.0f} |",
        f"| ratio (rlaif / TRL) | {med['ours']['pairs_per_s'] / med['trl']['pairs_per_s']:.2f}x | "
        f"{med['ours']['peak_rss_mib'] / med['trl']['peak_rss_mib']:.2f}x | |",
        "",
    ]
    print("\n".join(table))
    with open("BENCHMARKS.md", "a") as f:
        f.write("\n" + "\n".join(table))


if __name__ == "__main__":
    main()

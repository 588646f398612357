"""Reward-model training throughput and peak memory: rlaif's train_rm against TRL's RewardTrainer.

Same backbone (MiniLM-L6), same labels (the first label shard of a finished run, hard-oriented for TRL, which has
no soft labels), same tokenized (prompt, response) inputs, batch size, max length, dropout (the backbone's own, as
train_rm trains; TRL's default would switch it off), no activation checkpointing (TRL's default is on), one process
each with the same threads, no checkpoints. Each trainer runs in its own process, so peak RSS is its own. Medians
over --trials.

    .venv-bench/bin/python bench/bench_reward_model.py --source-run runs/demo --trials 3
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import append, peak_memory_key, report_result, side_by_side  # noqa: E402

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

    cfg = load_config("configs/demo.yaml", [f"storage.root={run.parent}", "run_id=bench-rm",
                                            f"train_rm.batch_size={BATCH}", f"train_rm.max_length={MAX_LEN}",
                                            f"train_rm.lr={LR}", "train_rm.checkpoint_every=0",
                                            "train_rm.nproc=1"])  # this one process, as TRL's worker
    run_stage(cfg, "train_rm")
    summary = json.loads((run / "train_rm" / "manifest.json").read_text())["summary"]
    return {"pairs_per_s": summary["samples_per_s"], "steps": summary["steps"]}


def worker_trl(run: Path) -> dict:
    import torch
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
        chosen, rejected = ((s["response_a.txt"], s["response_b.txt"]) if a_wins
                            else (s["response_b.txt"], s["response_a.txt"]))
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            rows[f"{name}_ids"].append(tok(s["prompt.txt"], text, truncation=True, max_length=MAX_LEN)["input_ids"])
    model = AutoModelForSequenceClassification.from_pretrained(str(minilm_dir()), num_labels=1)
    args = RewardConfig(output_dir=str(run / "trl-out"), per_device_train_batch_size=BATCH, num_train_epochs=1,
                        learning_rate=LR, max_length=MAX_LEN, report_to=[], save_strategy="no", logging_steps=10**6,
                        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), fp16=False,
                        dataloader_num_workers=0, disable_tqdm=True,
                        disable_dropout=False,  # TRL turns the backbone's dropout off by default; train_rm keeps it
                        gradient_checkpointing=False)  # and recomputes activations by default; train_rm does not
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
        report_result((worker_ours if a.worker == "ours" else worker_trl)(Path(a.run)))
        return
    import trl

    run = labels_subset(Path(a.source_run), Path("runs"))

    def fresh(_who):
        if (run / "train_rm").exists():
            shutil.rmtree(run / "train_rm")

    med = side_by_side(__file__, ("ours", "trl"), a.trials, ["--run", str(run)], ("pairs_per_s", "steps"), fresh)
    o, t = med["ours"], med["trl"]
    mem, mem_title = peak_memory_key()
    append(f"Reward-model training vs TRL RewardTrainer (trl {trl.__version__}; median of {a.trials})", "\n".join([
        f"| trainer | pairs/s | {mem_title} | steps |", "|---|---|---|---|",
        f"| rlaif train_rm | {o['pairs_per_s']:.2f} | {o[mem]:.0f} | {o['steps']:.0f} |",
        f"| TRL RewardTrainer | {t['pairs_per_s']:.2f} | {t[mem]:.0f} | {t['steps']:.0f} |",
        f"| ratio (rlaif / TRL) | {o['pairs_per_s'] / t['pairs_per_s']:.2f}x | {o[mem] / t[mem]:.2f}x | |"]))

if __name__ == "__main__":
    main()

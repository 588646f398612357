"""Stage 3: train the preference (reward) model on the soft AI labels, DDP under torchrun.

Bradley-Terry on soft labels: loss = BCE(sigmoid(r(x, a) - r(x, b)), p_a). Every rank reads the labels, the epoch
order comes from a seeded permutation of the whole training set, and each global batch is split across ranks, so
1 and N processes see the same global batches. A stable key-hash split holds pairs out for accuracy and calibration.
Exports a Hugging Face directory (safetensors) with reward_stats.json (mean/std of rewards on the training set).
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from rlaif import distributed as dist
from rlaif.errors import UserError
from rlaif.io import storage
from rlaif.io.prompts import is_held_out
from rlaif.io.shards import read_all
from rlaif.models.loading import resolve
from rlaif.stages.common import StageContext

HELD_OUT_FRACTION = 0.1


def load_reward_model(path: Path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, use_safetensors=True)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


def reward(model, tokenizer, prompts: list[str], responses: list[str], max_length: int, device) -> torch.Tensor:
    enc = tokenizer(prompts, responses, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)
    return model(**enc).logits.squeeze(-1)


@torch.no_grad()
def batched_rewards(model, tokenizer, prompts, responses, max_length, device, batch_size=64) -> torch.Tensor:
    model.eval()
    out = [reward(model, tokenizer, prompts[i : i + batch_size], responses[i : i + batch_size], max_length, device)
           for i in range(0, len(prompts), batch_size)]
    return torch.cat(out) if out else torch.zeros(0)


def run(ctx: StageContext) -> dict:
    cfg, c = ctx.cfg, ctx.cfg.train_rm
    rank, world, device = dist.setup()
    torch.manual_seed(cfg.seed)
    if c.batch_size % world:
        raise UserError(f"train_rm.batch_size={c.batch_size} must be divisible by the {world} processes")

    samples = read_all(ctx.input_url("label"), ctx.inputs["label"])
    for s in samples:
        if "label.json" not in s or "p_a" not in s["label.json"]:
            raise UserError(f"label sample {s['__key__']} has no label.json with p_a: re-run stage 'label'")
    held_flags = [is_held_out(s["__key__"], HELD_OUT_FRACTION, salt="train_rm:") for s in samples]
    train = [s for s, h in zip(samples, held_flags) if not h]
    held = [s for s, h in zip(samples, held_flags) if h]
    steps_per_epoch = len(train) // c.batch_size
    if steps_per_epoch == 0:
        raise UserError(f"only {len(train)} training pairs for train_rm.batch_size={c.batch_size}: lower the batch size")
    total_steps = steps_per_epoch * c.epochs

    tokenizer, model = load_reward_model(resolve(c.backbone, "reward-model backbone"))
    model.to(device).train()
    ddp = DDP(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
    warmup = max(1, int(c.warmup_fraction * total_steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (total_steps - s) / max(1, total_steps - warmup)))
    )
    use_amp = device.type == "cuda"
    local = c.batch_size // world

    metrics_path = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    bar = tqdm(total=total_steps, desc="train_rm", unit="step", disable=rank != 0)
    start, step = time.time(), 0
    for epoch in range(c.epochs):
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        for b in range(steps_per_epoch):
            ids = order[b * c.batch_size : (b + 1) * c.batch_size][rank * local : (rank + 1) * local]
            batch = [train[i] for i in ids]
            prompts = [s["prompt.txt"] for s in batch]
            target = torch.tensor([s["label.json"]["p_a"] for s in batch], device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                r = reward(ddp, tokenizer, prompts + prompts, [s["response_a.txt"] for s in batch] + [s["response_b.txt"] for s in batch],
                           c.max_length, device).float()
            margin = r[:local] - r[local:]
            loss = F.binary_cross_entropy_with_logits(margin, target)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            stats = dist.all_reduce_mean({"loss": loss.item(), "accuracy": ((margin > 0) == (target > 0.5)).float().mean().item()})
            if rank == 0:
                row = {"step": step, "epoch": epoch, **stats, "lr": sched.get_last_lr()[0], "grad_norm": float(grad_norm),
                       "samples_per_s": step * c.batch_size / (time.time() - start)}
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['accuracy']:.2f}")
                bar.update()
    bar.close()

    result = None
    if rank == 0:
        model.eval()
        r_a = batched_rewards(model, tokenizer, [s["prompt.txt"] for s in held], [s["response_a.txt"] for s in held], c.max_length, device)
        r_b = batched_rewards(model, tokenizer, [s["prompt.txt"] for s in held], [s["response_b.txt"] for s in held], c.max_length, device)
        p = torch.tensor([s["label.json"]["p_a"] for s in held])
        pred = torch.sigmoid((r_a - r_b).cpu())
        confident = (p - 0.5).abs() >= 0.25
        train_r = batched_rewards(model, tokenizer, [s["prompt.txt"] for s in train] * 2,
                                  [s["response_a.txt"] for s in train] + [s["response_b.txt"] for s in train], c.max_length, device)
        summary = {
            "train_pairs": len(train), "held_out_pairs": len(held), "steps": total_steps,
            "held_out_accuracy": ((pred > 0.5) == (p > 0.5)).float().mean().item() if held else None,
            "held_out_accuracy_confident": ((pred > 0.5) == (p > 0.5))[confident].float().mean().item() if confident.any() else None,
            "held_out_soft_ce": F.binary_cross_entropy(pred.clamp(1e-6, 1 - 1e-6), p).item() if held else None,
            "held_out_calibration_mae": (pred - p).abs().mean().item() if held else None,
            "reward_mean": train_r.mean().item(), "reward_std": train_r.std().item(),
            "samples_per_s": total_steps * c.batch_size / (time.time() - start),
        }
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "model"
            model.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)
            (out / "reward_stats.json").write_text(json.dumps({"mean": summary["reward_mean"], "std": summary["reward_std"],
                                                               "max_length": c.max_length}))
            files = [dict(f, path="model/" + f["path"]) for f in storage.upload_dir(out, storage.join(ctx.url, "model"))]
        storage.upload_file(metrics_path, storage.join(ctx.url, "metrics.jsonl"))
        files.append({"path": "metrics.jsonl", "bytes": metrics_path.stat().st_size, "sha256": storage.sha256_file(metrics_path)})
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"train_rm: {total_steps} steps, held-out accuracy {fmt(summary['held_out_accuracy'])} "
              f"({fmt(summary['held_out_accuracy_confident'])} on confident pairs), {summary['samples_per_s']:.1f} pairs/s")
        result = ctx.commit(files=files, num_samples=len(train), summary=summary)
    dist.barrier()
    dist.teardown()
    return result

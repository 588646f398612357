"""Stage 3: train the preference (reward) model on the soft AI labels, DDP (or DeepSpeed ZeRO) under torchrun.

Bradley-Terry on soft labels: loss = BCE(sigmoid(r(x, a) - r(x, b) - margin * (2p - 1)), p), p = P(a preferred).
Labels stream from the label stage's shards with a seeded shuffle buffer; a key-hash split holds pairs out.
Data modes (`train_rm.data_split`):
  batch: every rank streams the same seeded order and trains on its slice of each global batch, so 1 and N
         processes take identical steps (the default; each rank reads the whole label set, which is small text).
  shard: each rank and DataLoader worker streams disjoint shards; ranks agree on the number of steps each epoch.
Checkpoints every `checkpoint_every` steps (model, optimizer, schedule, RNG, data position) and resumes from the
newest one on restart. Exports a Hugging Face directory (safetensors) with reward_stats.json (mean/std of rewards on
the training pairs, which PPO uses to normalise), and reports held-out accuracy and calibration. With
train_rm.student.layers, a smaller student distilled from it goes in model/student/ (a restarted stage distills
again from the trained teacher).
"""
from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F

from rlaif import distributed as dist
from rlaif import faults
from rlaif.algo.preference import bradley_terry_loss
from rlaif.errors import UserError
from rlaif.io import storage
from rlaif.io.prompts import is_held_out, load_prompts
from rlaif.io.shards import read_samples, shuffled, shuffled_stream
from rlaif.judges.reference import CLEAR_MARGIN as CLEAR
from rlaif.judges.reference import grader as reference_grader
from rlaif.models import card
from rlaif.models.cpu_kernels import fuse
from rlaif.models.distill import distill_student, save_student
from rlaif.models.files import save_model, save_tokenizer
from rlaif.models.loading import check_backbone_fits, resolve
from rlaif.models.reward import batched_rewards, load_reward_model, reward
from rlaif.progress import progress
from rlaif.stages.common import StageContext
from rlaif.tracking import Tracker
from rlaif.training import Checkpoints, Engine, refuse_diverged


def held_out(key: str, fraction: float) -> bool:
    """The reward model's held-out pairs: one rule for training and evaluation, independent of the prompt split."""
    return is_held_out(key, fraction, salt="train_rm:")


def checked(sample: dict) -> dict:
    if "label.json" not in sample or "p_a" not in sample["label.json"] or "response_b.txt" not in sample:
        raise UserError(f"label sample {sample['__key__']} lacks label.json/p_a or a response: re-run stage 'label'")
    return sample


class _ShardSplitStream(torch.utils.data.IterableDataset):
    """`shard` mode: this rank's and this DataLoader worker's disjoint shards, shuffled with a seeded buffer."""

    def __init__(self, url, manifest, rank, world, seed, buffer_size, keep):
        self.args = (url, manifest, rank, world, seed, buffer_size, keep)

    def __iter__(self):
        url, manifest, rank, world, seed, buffer_size, keep = self.args
        info = torch.utils.data.get_worker_info()
        worker = info.id if info else 0
        samples = (checked(s) for s in read_samples(url, manifest, rank, world) if keep(s))
        return shuffled(samples, buffer_size, random.Random(f"{seed}:{rank}:{worker}"))


def micro_batches(ctx: StageContext, epoch: int, rank: int, world: int, micro_local: int):
    """This rank's micro-batches for one epoch of training pairs."""
    settings, url, label_manifest = ctx.cfg.train_rm, ctx.input_url("label"), ctx.inputs["label"]
    keep = lambda s: not held_out(s["__key__"], settings.held_out_fraction)  # noqa: E731
    if settings.data_split == "shard":
        data = _ShardSplitStream(url, label_manifest, rank, world, (ctx.cfg.seed, epoch), settings.shuffle_buffer, keep)
        yield from torch.utils.data.DataLoader(data, batch_size=micro_local, num_workers=settings.data_workers,
                                               collate_fn=list, drop_last=True)
        return
    stream = (checked(s) for s in shuffled_stream(url, label_manifest, (ctx.cfg.seed, epoch), settings.shuffle_buffer)
              if keep(s))
    micro_global = micro_local * world
    while len(batch := list(islice(stream, micro_global))) == micro_global:
        yield batch[rank * micro_local : (rank + 1) * micro_local]


def step_windows(ctx: StageContext, epoch: int, rank: int, world: int, micro_local: int, skip: int):
    """One optimizer step's micro-batches at a time. A resumed epoch reads the same order and skips the `skip` steps
    it already took; in `shard` mode ranks may run out at different times, so all stop together."""
    settings = ctx.cfg.train_rm
    batches = micro_batches(ctx, epoch, rank, world, micro_local)
    for _ in range(skip * settings.grad_accum_steps):
        next(batches, None)
    while True:
        window = list(islice(batches, settings.grad_accum_steps))
        have = torch.tensor([float(len(window) == settings.grad_accum_steps)])
        if settings.data_split == "shard":
            have = dist.all_reduce_min(have)
        if have.item() < 1:
            return
        yield window


def plan_steps(ctx: StageContext, world: int) -> tuple[int, int]:
    """(pairs per micro-batch on this rank, estimated total optimizer steps: the schedule's and the bar's length;
    the data decides the real end)."""
    settings = ctx.cfg.train_rm
    settings.check_processes(world)
    train_pairs = settings.training_pairs(ctx.inputs["label"]["num_samples"])
    if train_pairs // settings.batch_size == 0:
        fix = "lower the batch size" if train_pairs else "add prompts (or lower train_rm.held_out_fraction)"
        raise UserError(f"only about {train_pairs} training pairs for train_rm.batch_size={settings.batch_size}: "
                        f"{fix}")
    total_steps = train_pairs // settings.batch_size * settings.epochs
    return settings.batch_size // (world * settings.grad_accum_steps), total_steps


def run(ctx: StageContext) -> dict:
    settings = ctx.cfg.train_rm
    rank, world, device = dist.setup()
    micro_local, total_steps = plan_steps(ctx, world)

    torch.manual_seed(ctx.cfg.seed)
    backbone = resolve(settings.backbone, "reward-model backbone")
    check_backbone_fits(settings, backbone)
    tokenizer, model = load_reward_model(backbone, settings.lora_rank, settings.lora_alpha)
    model.to(device).train()
    fuse(model, device)  # fused element-wise kernels for Llama-family backbones on CPUs
    engine = Engine(model, strategy=settings.strategy, zero_stage=settings.zero_stage, optimizer=settings.optimizer,
                    lr=settings.lr, weight_decay=settings.weight_decay, grad_clip=settings.grad_clip,
                    accum_steps=settings.grad_accum_steps, micro_batch=micro_local,
                    warmup_steps=int(settings.warmup_fraction * total_steps), total_steps=total_steps, device=device)
    checkpoints = Checkpoints(ctx.url, ctx.config_hash, keep=settings.keep_checkpoints)
    position = checkpoints.restore(engine) or {"epoch": 0, "step_in_epoch": 0, "step": 0, "seconds": 0.0, "rows": []}

    metrics, step, seconds = train(ctx, engine, tokenizer, checkpoints, position, micro_local, total_steps)
    replica_spread = engine.replica_spread()

    export_root = Path(tempfile.mkdtemp(prefix="rlaif-rm-"))
    try:  # the exported weights are large: never left behind
        plain = export(ctx, engine, model, tokenizer, export_root / "model", rank, device)
        summary = evaluate_reward_model(ctx, plain.eval(), tokenizer, rank, world, device)
        if settings.student.layers:
            summary["student"] = distill(ctx, plain, tokenizer, summary, export_root / "model" / "student", device)
        summary.update(steps=step, seconds=seconds, samples_per_s=step * settings.batch_size / max(seconds, 1e-9),
                       world_size=world, replica_param_spread=replica_spread)
        result = publish(ctx, export_root / "model", metrics, summary) if rank == 0 else None
    finally:
        shutil.rmtree(export_root, ignore_errors=True)
    dist.teardown()
    return result


def distill(ctx: StageContext, teacher, tokenizer, summary: dict, out: Path, device) -> dict:
    """train_rm.student: the distilled reward model (rlaif/models/distill.py), its agreement with the teacher and its
    held-out accuracy against the AI labels; rank 0 exports it beside the teacher with the teacher's normalisation."""
    labels = (checked(s) for s in read_samples(ctx.input_url("label"), ctx.inputs["label"]))
    student, result = distill_student(ctx.cfg, labels, teacher, tokenizer, summary["reward_std"], device)
    result["held_out_accuracy"] = evaluate_reward_model(ctx, student, tokenizer, dist.rank(), dist.world_size(),
                                                        device)["held_out_accuracy"]
    if dist.rank() == 0:
        save_student(student, tokenizer, out, {"mean": summary["reward_mean"], "std": summary["reward_std"],
                                               "max_length": result["max_length"]})
    return result


def train(ctx: StageContext, engine, tokenizer, checkpoints: Checkpoints, position: dict, micro_local: int,
          total_steps: int) -> tuple[Tracker, int, float]:
    """The training loop from `position` (a fresh start or a checkpoint); returns (metrics, steps, seconds)."""
    settings = ctx.cfg.train_rm
    rank, world, device = dist.rank(), dist.world_size(), engine.device
    rows = position["rows"]  # the metrics up to the checkpoint
    metrics = Tracker(ctx, enabled=rank == 0, resume_step=position["step"],
                      restored_rows=[(row["step"], row) for row in rows])
    use_amp = device.type == "cuda" and settings.strategy == "ddp"  # DeepSpeed runs bf16 itself on GPUs
    bar = progress(total=total_steps, initial=position["step"], desc="train_rm", unit="step", disable=rank != 0)
    step, start = position["step"], time.time() - position["seconds"]
    for epoch in range(position["epoch"], settings.epochs):
        skip = position["step_in_epoch"] if epoch == position["epoch"] else 0
        windows = step_windows(ctx, epoch, rank, world, micro_local, skip)
        for step_in_epoch, window in enumerate(windows, start=skip + 1):
            loss_sum, correct = accumulate_gradients(engine, tokenizer, window, settings, device, use_amp)
            grad_norm = engine.step()
            step += 1
            stats = dist.all_reduce_mean({"loss": loss_sum, "accuracy": correct})
            checked = {**stats, **({"grad_norm": grad_norm} if engine.strategy != "deepspeed" else {})}
            refuse_diverged(checked, ("loss", "grad_norm"), f"train_rm diverged at step {step}", "lower train_rm.lr, "
                            "then run it again")
            pairs_per_s = (step - position["step"]) * settings.batch_size / max(time.time() - start
                                                                                 - position["seconds"], 1e-9)
            row = {**stats, "epoch": epoch, "lr": engine.lr(), "grad_norm": grad_norm, "samples_per_s": pairs_per_s}
            metrics.log(step, row)
            rows.append({"step": step, **row})
            bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['accuracy']:.2f}")
            bar.update()
            if settings.checkpoint_every and step % settings.checkpoint_every == 0:
                checkpoints.save(engine, step, {"epoch": epoch, "step_in_epoch": step_in_epoch, "step": step,
                                                "seconds": time.time() - start, "rows": rows})
                faults.maybe_kill("train_rm", step, rank)
    bar.total = step  # the length was estimated from the held-out fraction; the data decided the end
    bar.close()
    return metrics, step, time.time() - start


def publish(ctx: StageContext, export_dir: Path, metrics: Tracker, summary: dict) -> dict:
    """Rank 0: reward_stats.json beside the model (PPO normalises with it), the upload, the log line, the commit."""
    card.write(export_dir, card.reward_model_card(ctx, summary))
    stats_file = export_dir / "reward_stats.json"
    stats_file.write_text(json.dumps({"mean": summary["reward_mean"], "std": summary["reward_std"],
                                      "max_length": ctx.cfg.train_rm.max_length}))
    files = [dict(f, path="model/" + f["path"])
             for f in storage.upload_dir(export_dir, storage.join(ctx.url, "model"))]
    files += metrics.publish((export_dir / "README.md",))
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"train_rm: {summary['steps']} steps, held-out accuracy {fmt(summary['held_out_accuracy'])} "
          f"({fmt(summary['held_out_accuracy_confident'])} on confident pairs, "
          f"{fmt(summary['held_out_reference_accuracy'])} against the reference judge), "
          f"{summary['samples_per_s']:.1f} pairs/s")
    if "student" in summary:
        student = summary["student"]
        print(f"train_rm: student ({student['layers']} of the teacher's layers, {student['parameters'] / 1e6:.1f}M "
              f"parameters) agrees with the teacher on {fmt(student['pairwise_agreement'])} of held-out pairs "
              f"(Spearman {fmt(student['spearman'])}), held-out accuracy {fmt(student['held_out_accuracy'])}")
    return ctx.commit(files=files, num_samples=summary["train_pairs"], summary=summary)


def accumulate_gradients(engine, tokenizer, window: list[list[dict]], settings, device,
                         use_amp: bool) -> tuple[float, float]:
    """Bradley-Terry backward passes over one optimizer step's micro-batches; returns (mean loss, mean accuracy)."""
    loss_sum, correct = 0.0, 0.0
    for batch in window:
        prompts = [s["prompt.txt"] for s in batch]
        target = torch.tensor([s["label.json"]["p_a"] for s in batch], device=device)
        with engine.accumulating(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            responses = [s["response_a.txt"] for s in batch] + [s["response_b.txt"] for s in batch]
            r = reward(engine, tokenizer, prompts + prompts, responses, settings.max_length, device).float()
            loss = bradley_terry_loss(r[: len(batch)], r[len(batch):], target, settings.margin)
            engine.backward(loss)
        loss_sum += loss.item() / len(window)
        correct += ((r[: len(batch)] > r[len(batch):]) == (target > 0.5)).float().mean().item() / len(window)
    return loss_sum, correct


def export(ctx: StageContext, engine, model, tokenizer, export_dir: Path, rank: int, device):
    """Whole weights as a Hugging Face directory (ZeRO-3 gathers its partitions; LoRA is merged), written by rank 0;
    returns the model to evaluate: the live one, or under DeepSpeed (which owns and may partition the live
    parameters) the export read back."""
    settings = ctx.cfg.train_rm
    with engine.full_parameters():
        plain = model.merge_and_unload() if settings.lora_rank > 0 else model
        if rank == 0:
            save_model(plain, export_dir)
            save_tokenizer(tokenizer, export_dir)
            if settings.strategy == "deepspeed":  # the other ranks read the export back from storage
                storage.upload_dir(export_dir, storage.join(ctx.url, "model"))
    dist.barrier()
    if settings.strategy != "deepspeed":
        engine.optimizer.state.clear()  # the Adam moments are done with: free them before evaluating
        return plain
    model_url = storage.join(ctx.url, "model")
    files = [{"path": name, "sha256": None} for name in storage.list_files(model_url)]
    return load_reward_model(storage.download_dir(model_url, files))[1].to(device)


@torch.no_grad()
def evaluate_reward_model(ctx: StageContext, model, tokenizer, rank: int, world: int, device) -> dict:
    """Reward mean/std on the training pairs, held-out accuracy and calibration; the pairs are split across ranks."""
    settings = ctx.cfg.train_rm
    grader = reference_grader(load_prompts(ctx.cfg.data), ctx.cfg.label.reference)
    # n_train, r_sum, r_sq, n_held, correct, n_conf, correct_conf, ce, mae, n_reference_clear, correct_reference
    sums = torch.zeros(11, dtype=torch.float64)
    held_pred, held_p = [], []
    batch: list[dict] = []

    def flush():
        prompts = [s["prompt.txt"] for s in batch]
        responses_a, responses_b = [s["response_a.txt"] for s in batch], [s["response_b.txt"] for s in batch]
        r_a = batched_rewards(model, tokenizer, prompts, responses_a, settings.max_length, device).double()
        r_b = batched_rewards(model, tokenizer, prompts, responses_b, settings.max_length, device).double()
        held = torch.tensor([held_out(s["__key__"], settings.held_out_fraction) for s in batch])
        train_r = torch.cat([r_a[~held], r_b[~held]])
        sums[0] += len(train_r)
        sums[1] += train_r.sum()
        sums[2] += train_r.square().sum()
        held_pred.extend(torch.sigmoid(r_a - r_b)[held].tolist())
        held_p.extend(s["label.json"]["p_a"] for s, h in zip(batch, held.tolist()) if h)
        graded = grader.prefer_first_where_graded(prompts, responses_a, responses_b) if grader else {}
        for k, p_ref in graded.items():
            if held[k] and abs(p_ref - 0.5) >= CLEAR:
                sums[9] += 1
                sums[10] += bool((r_a[k] > r_b[k]) == (p_ref > 0.5))
        batch.clear()

    for sample in read_samples(ctx.input_url("label"), ctx.inputs["label"], rank, world, 0, 1):
        batch.append(checked(sample))
        if len(batch) == 64:
            flush()
    if batch:
        flush()
    pred, p = torch.tensor(held_pred, dtype=torch.float64), torch.tensor(held_p, dtype=torch.float64)
    confident = (p - 0.5).abs() >= 0.25
    agree = ((pred > 0.5) == (p > 0.5)).double()
    sums[3], sums[4] = len(held_pred), agree.sum()
    sums[5], sums[6] = confident.sum(), agree[confident].sum()
    sums[7] = F.binary_cross_entropy(pred.clamp(1e-6, 1 - 1e-6), p, reduction="sum") if len(held_pred) else 0.0
    sums[8] = (pred - p).abs().sum()
    totals = dist.all_reduce_sum(sums)
    n_train, n_held, n_conf = totals[0].item(), totals[3].item(), totals[5].item()
    mean = totals[1].item() / max(n_train, 1)
    return {
        "train_pairs": int(n_train // 2), "held_out_pairs": int(n_held),
        "reward_mean": mean, "reward_std": max(totals[2].item() / max(n_train, 1) - mean * mean, 0.0) ** 0.5,
        "held_out_accuracy": totals[4].item() / n_held if n_held else None,
        "held_out_accuracy_confident": totals[6].item() / n_conf if n_conf else None,
        "held_out_soft_ce": totals[7].item() / n_held if n_held else None,
        "held_out_calibration_mae": totals[8].item() / n_held if n_held else None,
        # against the reference judge (ground truth where the prompts carry key points), on its clear preferences
        "held_out_reference_accuracy": totals[10].item() / totals[9].item() if totals[9] else None,
        "held_out_reference_pairs": int(totals[9].item()),
    }

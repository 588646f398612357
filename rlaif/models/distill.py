"""Reward-model distillation (train_rm.student): a student cut from the trained teacher, fitted to its scores.

The distillation set is every labeled response plus `policy_samples` responses the starting policy samples for each
of PPO's training prompts (what PPO will score), each scored by the teacher. Ranks split the sampling and scoring,
then all hold the same set in the same order (by item key) and train the student with DDP on slices of each global
batch; the ranking term compares the pairs within each process's slice.
Prompts are held out by a hash of their text: the student's agreement with the teacher is measured on them.
"""
from __future__ import annotations

import copy
import hashlib
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from rlaif import distributed as dist
from rlaif.algo.distill import distill_loss, pairwise_agreement, pearson, spearman
from rlaif.errors import UserError
from rlaif.io.prompts import is_held_out, split
from rlaif.models.files import save_model, save_tokenizer
from rlaif.models.generation import sample_texts
from rlaif.models.loading import load_policy
from rlaif.models.prompt_text import format_prompts
from rlaif.models.reward import batched_rewards, reward
from rlaif.training import Engine, refuse_diverged

SAMPLE_BATCH = 64  # prompts per sampling batch


def truncate_layers(model: nn.Module, layers: int) -> nn.Module:
    """`model` cut to its first `layers` transformer blocks: the ModuleList as long as config.num_hidden_layers
    (BERT's encoder.layer, Llama's model.layers, ...), with the config changed to match."""
    total = model.config.num_hidden_layers
    if not 0 < layers < total:
        raise UserError(f"train_rm.student.layers={layers} must be between 1 and the teacher's {total - 1} "
                        f"(it has {total} layers)")
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == total:
                setattr(module, name, child[:layers])
                model.config.num_hidden_layers = layers
                if getattr(model.config, "layer_types", None):
                    model.config.layer_types = model.config.layer_types[:layers]
                return model
    raise UserError(f"train_rm.student: found no list of {total} layers in the {type(model).__name__} backbone to "
                    "cut; set train_rm.student.layers=0")


def sample_seed(seed: int, prompt_id: str, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:student:{prompt_id}:{index}".encode()).digest()[:8], "big") >> 1


def labeled_items(label_samples) -> list[dict]:
    """Both responses of every labeled pair; a pair is a group (its two responses are compared)."""
    items = []
    for sample in label_samples:
        for side in ("a", "b"):
            items.append({"key": f"{sample['__key__']}:{side}", "group": sample["__key__"],
                          "prompt": sample["prompt.txt"], "response": sample[f"response_{side}.txt"]})
    return items


def policy_items(cfg, device) -> list[dict]:
    """This rank's share of the starting policy's responses to PPO's training prompts (in PPO's order, capped)."""
    settings = cfg.train_rm.student
    if not settings.policy_samples:
        return []
    prompts = split(cfg.data, "train")
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    chosen = [prompts[i] for i in order[: settings.max_prompts or len(prompts)]]
    mine = chosen[dist.rank() :: dist.world_size()]
    tokenizer, policy = load_policy(cfg.policy)
    policy.to(device)
    sampling = SimpleNamespace(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=1.0,
                               top_k=0, stop=[])
    items = []
    for start in range(0, len(mine), SAMPLE_BATCH):
        batch = mine[start : start + SAMPLE_BATCH]
        jobs = [(row, j) for row in batch for j in range(settings.policy_samples)]
        texts = format_prompts(tokenizer, cfg.policy, [row["prompt"] for row, _ in jobs])
        seeds = [sample_seed(cfg.seed, row["id"], j) for row, j in jobs]
        for (row, j), (response, _) in zip(jobs, sample_texts(policy, tokenizer, texts, seeds, device, sampling)):
            items.append({"key": f"policy:{row['id']}:{j}", "group": f"policy:{row['id']}", "prompt": row["prompt"],
                          "response": response})
    del policy
    return items


def score_and_share(items: list[dict], teacher, tokenizer, max_length: int, device) -> list[dict]:
    """Teacher scores for this rank's items, then every rank's items on every rank, sorted by key."""
    scores = batched_rewards(teacher, tokenizer, [i["prompt"] for i in items], [i["response"] for i in items],
                             max_length, device).tolist()
    scored = [dict(item, teacher=score) for item, score in zip(items, scores)]
    if dist.world_size() > 1:
        gathered = [None] * dist.world_size()
        torch.distributed.all_gather_object(gathered, scored)
        scored = [item for part in gathered for item in part]
    return sorted(scored, key=lambda item: item["key"])


def distill_student(cfg, label_samples, teacher, tokenizer, teacher_std: float, device) -> tuple[nn.Module, dict]:
    """Build the distillation set, train the student on it, measure its agreement; returns (student, summary)."""
    settings, started = cfg.train_rm.student, time.time()
    max_length = settings.max_length or cfg.train_rm.max_length
    labeled = labeled_items(label_samples)
    mine = labeled[dist.rank() :: dist.world_size()] + policy_items(cfg, device)
    items = score_and_share(mine, teacher.eval(), tokenizer, cfg.train_rm.max_length, device)
    held = [is_held_out(item["prompt"], settings.held_out_fraction, salt="student:") for item in items]
    train_items = [item for item, h in zip(items, held) if not h]
    test_items = [item for item, h in zip(items, held) if h]

    student = truncate_layers(copy.deepcopy(teacher), settings.layers).to(device)
    student.requires_grad_(True)  # the score head's bias too: matching scores (not only gaps) gives it a gradient
    seconds_training = train_student(cfg, student, tokenizer, train_items, max_length, max(teacher_std, 1e-6),
                                     device)
    summary = agreement(student.eval(), tokenizer, test_items, max_length, device)
    summary.update(layers=settings.layers, train_items=len(train_items),
                   policy_samples=sum(item["key"].startswith("policy:") for item in items),
                   parameters=sum(p.numel() for p in student.parameters()),
                   teacher_parameters=sum(p.numel() for p in teacher.parameters()),
                   train_seconds=seconds_training, seconds=time.time() - started, max_length=max_length)
    return student, summary


def train_student(cfg, student, tokenizer, items: list[dict], max_length: int, scale: float, device) -> float:
    """DDP over the ranks: each takes its slice of every global batch, in one seeded order for any process count."""
    settings, world, rank = cfg.train_rm.student, dist.world_size(), dist.rank()
    micro = settings.batch_size // world
    steps_per_epoch = len(items) // settings.batch_size
    if not steps_per_epoch:
        raise UserError(f"only {len(items)} responses to distill on for train_rm.student.batch_size="
                        f"{settings.batch_size}: lower it")
    total = steps_per_epoch * settings.epochs
    engine = Engine(student, strategy="ddp", zero_stage=2, optimizer="adamw", lr=settings.lr,
                    weight_decay=cfg.train_rm.weight_decay, grad_clip=cfg.train_rm.grad_clip, accum_steps=1,
                    micro_batch=micro, warmup_steps=int(0.1 * total), total_steps=total, device=device)
    use_amp, started = device.type == "cuda", time.time()
    for epoch in range(settings.epochs):
        order = list(range(len(items)))
        random.Random(f"{cfg.seed}:student:{epoch}").shuffle(order)
        for step in range(steps_per_epoch):
            batch = [items[i] for i in order[step * settings.batch_size : (step + 1) * settings.batch_size]]
            batch = batch[rank * micro : (rank + 1) * micro]
            target = torch.tensor([item["teacher"] for item in batch], device=device)
            with engine.accumulating(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                scores = reward(engine, tokenizer, [i["prompt"] for i in batch], [i["response"] for i in batch],
                                max_length, device).float()
                loss = distill_loss(scores, target, scale, settings.ranking_weight)
                engine.backward(loss)
            grad_norm = engine.step()
            # as the teacher's steps are checked: a student trained on NaN would be saved, shipped and used by ppo
            refuse_diverged(dist.all_reduce_mean({"loss": loss.item(), "grad_norm": grad_norm}), ("loss", "grad_norm"),
                            f"train_rm.student diverged at epoch {epoch + 1} step {step + 1}",
                            "lower train_rm.student.lr, then run it again")
    return time.time() - started


@torch.no_grad()
def agreement(student, tokenizer, items: list[dict], max_length: int, device) -> dict:
    """The student against the teacher on held-out prompts: pairwise ranking agreement within each prompt's
    responses (and each labeled pair), Pearson and Spearman correlation of the scores."""
    if not items:
        return {"held_out_items": 0, "pairwise_agreement": None, "pearson": None, "spearman": None}
    scores = batched_rewards(student, tokenizer, [i["prompt"] for i in items], [i["response"] for i in items],
                             max_length, device)
    teacher = torch.tensor([i["teacher"] for i in items])
    agree, pairs = pairwise_agreement(scores, teacher, [i["group"] for i in items])
    return {"held_out_items": len(items), "held_out_pairs": pairs,
            "pairwise_agreement": agree / pairs if pairs else None,
            "pearson": pearson(scores, teacher), "spearman": spearman(scores, teacher)}


def save_student(student, tokenizer, out: Path, stats: dict) -> None:
    """The student as a Hugging Face directory with the teacher's normalisation (it was fitted to the teacher's
    scores), so PPO's normalised scorer loads it as it loads the teacher."""
    save_model(student, out)
    save_tokenizer(tokenizer, out)
    (out / "reward_stats.json").write_text(json.dumps(stats))

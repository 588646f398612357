"""Stage 4: PPO fine-tuning of the policy against the reward model, multi-process under torchrun.

Per iteration: each rank takes its slice of a seeded global batch of prompts, samples responses, scores them with the
reward model (its own tokenizer, normalised by its saved mean/std, clipped), computes old log-probs and values in one
forward pass (the value head shares the policy's backbone) and reference log-probs with the LoRA adapter disabled,
puts the score on the last real response token with a per-token KL penalty, runs GAE, whitens advantages over all
ranks, and takes clipped PPO steps on shuffled minibatches (DDP averages gradients).
"""
from __future__ import annotations

import copy
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from rlaif import distributed as dist
from rlaif import report
from rlaif.algo import ppo as algo
from rlaif.errors import UserError
from rlaif.io import storage
from rlaif.io.prompts import split
from rlaif.models.generation import decode, encode_prompts, response_logits_and_hidden, response_mask, sample, token_logprobs
from rlaif.models.loading import load_policy
from rlaif.stages.common import StageContext, model_dir
from rlaif.stages.train_rm import batched_rewards, load_reward_model

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class PolicyWithValue(nn.Module):
    """The policy LM plus a scalar value head on its last hidden state (one backbone pass for both)."""

    def __init__(self, lm: nn.Module, hidden_size: int):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, prompt_ids, prompt_mask, responses, resp_mask):
        logits, hidden = response_logits_and_hidden(self.lm, prompt_ids, prompt_mask, responses, resp_mask, want_hidden=True)
        return logits, self.value_head(hidden).squeeze(-1)


def build_policy(cfg, device):
    """(trainable PolicyWithValue, function giving reference logits). LoRA: the reference is the adapter disabled."""
    c = cfg.ppo
    tokenizer, lm = load_policy(cfg.policy)
    if c.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        targets = [t for t in LORA_TARGETS if any(n.endswith(t) for n, _ in lm.named_modules())]
        lm = get_peft_model(lm, LoraConfig(r=c.lora_rank, lora_alpha=c.lora_alpha, lora_dropout=0.0, target_modules=targets))

        def reference_logits(*args):
            with lm.disable_adapter():
                return response_logits_and_hidden(lm, *args)[0]
    else:
        frozen = copy.deepcopy(lm).eval().requires_grad_(False).to(device)

        def reference_logits(*args):
            return response_logits_and_hidden(frozen, *args)[0]

    policy = PolicyWithValue(lm, lm.config.hidden_size).to(device)
    return tokenizer, policy, reference_logits


@torch.no_grad()
def rollout(cfg, policy, reference_logits, tokenizer, rm, rm_tokenizer, rm_stats, prompts, seed, device):
    c, timings = cfg.ppo, {}
    t0 = time.time()
    policy.eval()
    texts = [cfg.policy.prompt_template.format(prompt=p["prompt"]) for p in prompts]
    enc = encode_prompts(tokenizer, texts, device)
    responses = sample(policy.lm, tokenizer, enc, max_new_tokens=c.max_new_tokens, temperature=c.temperature, seed=seed)
    mask = response_mask(responses, tokenizer.eos_token_id)
    timings["generate_s"] = time.time() - t0

    t0 = time.time()
    decoded = decode(tokenizer, responses, mask)
    raw = batched_rewards(rm, rm_tokenizer, [p["prompt"] for p in prompts], decoded, rm_stats["max_length"], device)
    score = ((raw - rm_stats["mean"]) / max(rm_stats["std"], 1e-6)).clamp(-c.reward_clip, c.reward_clip)
    timings["score_s"] = time.time() - t0

    t0 = time.time()
    args = (enc["input_ids"], enc["attention_mask"], responses, mask)
    logits, values = policy(*args)
    old_logprobs = token_logprobs(logits, responses, c.temperature)
    ref_logprobs = token_logprobs(reference_logits(*args), responses, c.temperature)
    timings["reference_s"] = time.time() - t0

    maskf = mask.float()
    kl = algo.kl_penalty(old_logprobs, ref_logprobs, c.kl_estimator) * maskf
    rewards = algo.token_rewards(score, kl, maskf, c.kl_coef)
    advantages, returns = algo.gae(rewards, values * maskf, maskf, c.gamma, c.lam)
    advantages = algo.masked_whiten(advantages, maskf, all_reduce=dist.all_reduce_sum)
    batch = dict(prompt_ids=enc["input_ids"], prompt_mask=enc["attention_mask"], responses=responses, mask=mask,
                 old_logprobs=old_logprobs, old_values=values, advantages=advantages, returns=returns)
    stats = {"reward_raw": raw.mean().item(), "score": score.mean().item(), "kl": (kl.sum(1)).mean().item(),
             "response_length": maskf.sum(1).mean().item(),
             "explained_variance": algo.explained_variance(values, returns, maskf)}
    return batch, stats, timings


def update(cfg, model, policy, optimizer, batch, seed):
    c = cfg.ppo
    local = batch["responses"].shape[0]
    mb = c.minibatch_size // dist.world_size()
    policy.train()
    sums: dict[str, float] = {}
    n = 0
    for epoch in range(c.ppo_epochs):
        order = torch.randperm(local, generator=torch.Generator().manual_seed(seed * 31 + epoch))
        for start in range(0, local, mb):
            idx = order[start : start + mb]
            mask = batch["mask"][idx].float()
            logits, values = model(batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["responses"][idx], batch["mask"][idx])
            logprobs = token_logprobs(logits, batch["responses"][idx], c.temperature)
            pg_loss, pg_stats = algo.policy_loss(logprobs, batch["old_logprobs"][idx], batch["advantages"][idx], mask, c.clip_eps)
            vf_loss = algo.value_loss(values, batch["old_values"][idx], batch["returns"][idx], mask, c.value_clip)
            loss = pg_loss + c.vf_coef * vf_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], c.grad_clip)
            optimizer.step()
            with torch.no_grad():
                entropy = algo.masked_mean(algo.entropy_from_logits(logits.float() / c.temperature), mask).item()
            for k, v in {"policy_loss": pg_loss.item(), "value_loss": vf_loss.item(), "entropy": entropy, **pg_stats}.items():
                sums[k] = sums.get(k, 0.0) + v
            n += 1
    return {k: v / n for k, v in sums.items()}


def run(ctx: StageContext) -> dict:
    cfg, c = ctx.cfg, ctx.cfg.ppo
    rank, world, device = dist.setup()
    for name, value in (("rollout_batch_size", c.rollout_batch_size), ("minibatch_size", c.minibatch_size)):
        if value % world:
            raise UserError(f"ppo.{name}={value} must be divisible by the {world} processes")
    if (c.rollout_batch_size // world) % (c.minibatch_size // world):
        raise UserError("ppo.rollout_batch_size must be a multiple of ppo.minibatch_size")
    torch.manual_seed(cfg.seed)
    prompts = split(cfg.data, "train")

    tokenizer, policy, reference_logits = build_policy(cfg, device)
    rm_path = model_dir(ctx, "train_rm", "model")
    rm_tokenizer, rm = load_reward_model(rm_path)
    rm.to(device).eval().requires_grad_(False)
    rm_stats = json.loads((rm_path / "reward_stats.json").read_text())
    model = DDP(policy) if world > 1 else policy
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=c.lr, weight_decay=0.0)

    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    local = c.rollout_batch_size // world
    rows: list[dict] = []
    bar = tqdm(range(c.iterations), desc="ppo", unit="iter", disable=rank != 0)
    for it in bar:
        start = (it * c.rollout_batch_size) % len(prompts)
        global_ids = [order[(start + k) % len(prompts)] for k in range(c.rollout_batch_size)]
        my_prompts = [prompts[i] for i in global_ids[rank * local : (rank + 1) * local]]
        t_iter = time.time()
        batch, stats, timings = rollout(cfg, policy, reference_logits, tokenizer, rm, rm_tokenizer, rm_stats,
                                           my_prompts, seed=cfg.seed * 1_000_003 + it * 1009 + rank, device=device)
        t0 = time.time()
        train_stats = update(cfg, model, policy, optimizer, batch, seed=cfg.seed + it)
        timings["update_s"] = time.time() - t0
        timings["iteration_s"] = time.time() - t_iter
        row = {"iteration": it + 1, **dist.all_reduce_mean({**stats, **train_stats}), **timings}
        if rank == 0:
            rows.append(row)
            bar.set_postfix(reward=f"{row['reward_raw']:.2f}", kl=f"{row['kl']:.2f}")

    result = None
    if rank == 0:
        out = Path(tempfile.mkdtemp(prefix="rlaif-ppo-"))
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "reward_kl.png").write_bytes(report.ppo_curves(rows))
        lm = policy.lm
        if c.lora_rank > 0:
            lm.save_pretrained(out / "adapter", safe_serialization=True)
            lm = lm.merge_and_unload()
        lm.save_pretrained(out / "policy", safe_serialization=True)
        tokenizer.save_pretrained(out / "policy")
        files = storage.upload_dir(out, ctx.url)
        first, last = rows[0], rows[-1]
        summary = {"iterations": c.iterations, "reward_first": first["reward_raw"], "reward_last": last["reward_raw"],
                   "kl_last": last["kl"], "seconds_per_iteration": sum(r["iteration_s"] for r in rows) / len(rows)}
        print(f"ppo: reward {first['reward_raw']:.3f} -> {last['reward_raw']:.3f}, KL {last['kl']:.3f}, "
              f"{summary['seconds_per_iteration']:.2f}s/iteration")
        result = ctx.commit(files=files, num_samples=c.iterations * c.rollout_batch_size, summary=summary)
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    dist.teardown()
    return result

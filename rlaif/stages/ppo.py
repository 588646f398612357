"""Stage 4: PPO (or GRPO) fine-tuning of the policy against the reward model, multi-process under torchrun.

Per iteration: each rank takes its slice of a seeded global batch of prompts and samples responses (distributed
rollout), scores them with the reward model (its own tokenizer, normalised by its saved mean/std, clipped), computes
old log-probs and values in one forward pass (the value head shares the policy's backbone) and reference log-probs
with the LoRA adapter disabled. PPO puts the score on the last real response token with a per-token KL penalty, runs
GAE and whitens advantages over all ranks; GRPO scores each response against the other samples for its prompt.
The rollouts are then gathered, and every optimizer step takes a seeded minibatch of the whole global batch, split
over ranks and micro-batches with the loss normalised by the minibatch's token count: the update is the same for any
number of processes; GRPO's minibatches hold whole groups (ppo.group_minibatches), whose packed forwards run the
shared prompt once. DDP or DeepSpeed ZeRO through training.Engine; checkpoints resume exactly.
"""
from __future__ import annotations

import contextlib
import copy
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from rlaif import distributed as dist
from rlaif import faults, report
from rlaif.algo import ppo as algo
from rlaif.algo.batches import minibatch_order, pad_left, pad_right, trimmed
from rlaif.distributed import clock
from rlaif.errors import UserError
from rlaif.io import storage
from rlaif.io.prompts import split
from rlaif.judges import judge_scorer
from rlaif.models import card
from rlaif.models.adapters import adapter_folded, adapter_fused
from rlaif.models.files import save_model, save_tokenizer
from rlaif.models.generation import (
    backbone_and_head,
    decode,
    encode_prompts,
    fixed_length_tokens,
    is_stop,
    response_mask,
    sample,
    stop_ids,
)
from rlaif.models.policy import PolicyWithValue, build_policy
from rlaif.models.prompt_text import format_prompts
from rlaif.models.reward import reward_scorer
from rlaif.phases import RL_PHASES, phase, phase_peaks, process_peaks
from rlaif.progress import progress
from rlaif.stages.common import StageContext, model_dir
from rlaif.tracking import Tracker
from rlaif.training import Checkpoints, Engine, flat_reward_warning, refuse_diverged, saturated_sampling_warning


def autocast(enabled: bool):
    """A context factory: bf16 autocast on GPUs when enabled, else nothing (bf16 matmuls are slow on CPUs)."""
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if enabled else contextlib.nullcontext


def logprobs_from_sampling(settings, lm, device) -> bool:
    """ppo.rollout_logprobs: take the old log-probs and values from the sampler's hidden states? `auto` does in fp32
    (CPUs) and recomputes under bf16 (GPUs); both need a plain output head (backbone_and_head)."""
    if settings.rollout_logprobs == "recompute" or backbone_and_head(lm) is None:
        return False
    return settings.rollout_logprobs == "sampled" or device.type == "cpu"


def rollout_logprobs(policy, reference_logprobs, rows: dict, sampled_hidden, amp, chunk_rows: int):
    """Old log-probs, reference log-probs and values of a rollout [rows, max_new_tokens] (zeros past every response's
    end), `chunk_rows` rows at a time, each chunk without the columns that are padding in all its rows; the old ones
    and the values from the sampler's hidden states when it kept them (one policy forward fewer). Without a
    reference (a KL weight of 0) the reference log-probs are the old ones: a KL of 0, weighted 0."""
    width, parts = rows["responses"].shape[1], []
    for start in range(0, rows["responses"].shape[0], chunk_rows):
        index = slice(start, start + chunk_rows)
        real = trimmed(rows, index)
        args = (real["prompt_ids"], real["prompt_mask"], real["responses"], real["mask"])
        with amp():
            if sampled_hidden is None:
                old_logprobs, _, values = policy(*args)
            else:
                old_logprobs, values = policy.from_hidden(sampled_hidden[index, : args[2].shape[1]], args[2])
            ref_logprobs = reference_logprobs(policy, *args) if reference_logprobs is not None else old_logprobs
        parts.append([pad_right(x.float(), width, 0) for x in (old_logprobs, ref_logprobs, values)])
    return tuple(torch.cat(column) for column in zip(*parts))


@torch.no_grad()
def rollout(cfg, policy, reference_logprobs, tokenizer, reward_fn, prompts, seed, device, kl_coef, amp):
    """One rank's rollout: responses, scores, old/reference log-probs, values, advantages and returns."""
    settings, timings = cfg.ppo, {}
    grpo = settings.algorithm == "grpo"
    # The reward model and the reference run on the update's micro-batch of rows at a time: no phase holds more
    # activations than the update, and their buffers are the sizes the update's reuse.
    micro_rows = micro_batch_rows(settings)
    samples = settings.group_size if grpo else 1
    with phase("generate", timings):
        policy.eval()
        texts = format_prompts(tokenizer, cfg.policy, [p["prompt"] for p in prompts])
        enc = encode_prompts(tokenizer, texts, device)
        from_sampling = logprobs_from_sampling(settings, policy.lm, device)
        with amp(), adapter_folded(policy.lm):
            sampled = sample(policy.lm, tokenizer, enc, max_new_tokens=settings.max_new_tokens,
                             temperature=settings.temperature, num_return_sequences=samples, seed=seed,
                             min_new_tokens=fixed_length_tokens(settings), want_hidden=from_sampling)
        responses, sampled_hidden = sampled if from_sampling else (sampled, None)
        # A fixed response width: every rank's tensors line up for the gather before the update.
        responses = pad_right(responses, settings.max_new_tokens, tokenizer.pad_token_id)
        mask = response_mask(responses, stop_ids(tokenizer))
        prompt_ids = enc["input_ids"].repeat_interleave(samples, 0)  # generate() returns a prompt's samples together
        prompt_mask = enc["attention_mask"].repeat_interleave(samples, 0)

    with phase("score", timings):
        prompt_texts = [p["prompt"] for p in prompts for _ in range(samples)]
        raw = (reward_fn.score_tokens(prompt_texts, responses, mask, batch_size=micro_rows)
               if getattr(reward_fn, "token_ids", False)
               else reward_fn(prompt_texts, decode(tokenizer, responses, mask))).to(device)
        score = raw.clamp(-settings.reward_clip, settings.reward_clip)
        ended = (is_stop(responses, stop_ids(tokenizer)) & mask.bool()).any(1)
        if settings.missing_eos_penalty is not None:
            score = score - settings.missing_eos_penalty * (~ended).float()

    with phase("reference", timings):
        old_logprobs, ref_logprobs, values = rollout_logprobs(
            policy, reference_logprobs, dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, responses=responses,
                                             mask=mask), sampled_hidden, amp, micro_rows)

    maskf = mask.float()
    kl = algo.kl_penalty(old_logprobs, ref_logprobs, settings.kl_estimator) * maskf
    if grpo:
        advantages = algo.group_advantages(score, samples, maskf)
        values = returns = torch.zeros_like(maskf)
    else:
        rewards = algo.token_rewards(score, kl, maskf, kl_coef)
        # whitened after the gather
        advantages, returns = algo.gae(rewards, values * maskf, maskf, settings.gamma, settings.lam)
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, responses=responses, mask=mask,
                 old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, old_values=values, advantages=advantages,
                 returns=returns)
    stats = rollout_stats(raw, score, maskf, ended, kl if reference_logprobs is not None else None)
    if not grpo:
        stats["explained_variance"] = algo.explained_variance(values, returns, maskf)
    return batch, stats, timings


def rollout_stats(raw, score, maskf, ended, kl) -> dict:
    """A rollout's logged means; the KL to the reference only where there is one (`kl` None: none to measure)."""
    stats = {"reward_raw": raw.mean().item(), "reward_std": raw.std().item() if raw.numel() > 1 else 0.0,
             "score": score.mean().item(), "response_length": maskf.sum(1).mean().item(),
             "eos_rate": ended.float().mean().item()}
    return stats if kl is None else {**stats, "kl": kl.sum(1).mean().item()}


def gather_batch(batch: dict, pad_id: int) -> dict:
    """Every rank's rollout, concatenated in rank order on every rank (prompts left-padded to a common width)."""
    world = dist.world_size()
    if world == 1:
        return batch
    width = int(-dist.all_reduce_min(-torch.tensor([float(batch["prompt_ids"].shape[1])])).item())
    batch = dict(batch, prompt_ids=pad_left(batch["prompt_ids"], width, pad_id),
                 prompt_mask=pad_left(batch["prompt_mask"], width, 0))
    gathered = {}
    for key, tensor in batch.items():
        parts = [torch.empty_like(tensor) for _ in range(world)]
        torch.distributed.all_gather(parts, tensor.contiguous())
        gathered[key] = torch.cat(parts)
    return gathered


def whiten_advantages(cfg, batch: dict) -> dict:
    """PPO whitens advantages over the whole gathered batch (every rank holds it, so no collective is needed)."""
    if cfg.ppo.algorithm == "grpo":
        return batch
    return dict(batch, advantages=algo.masked_whiten(batch["advantages"], batch["mask"].float()))


def minibatch_step(settings, engine: Engine, batch: dict, mine: torch.Tensor, normalizer: float, kl_coef: float,
                   amp) -> dict:
    """One optimizer step on this rank's rows of a minibatch (`mine`), in grad_accum_steps micro-batches; its stats."""
    grpo, accum = settings.algorithm == "grpo", settings.grad_accum_steps
    micro = len(mine) // accum
    step = {"policy_loss": 0.0, "kl_loss" if grpo else "value_loss": 0.0, "entropy": 0.0, "clip_frac": 0.0,
            "approx_kl": 0.0}
    for j in range(accum):
        part = trimmed(batch, mine[j * micro : (j + 1) * micro])
        mask = part["mask"].float()
        with engine.accumulating(), amp():
            logprobs, entropy, values = engine(part["prompt_ids"], part["prompt_mask"], part["responses"],
                                               part["mask"])
            pg_loss, pg_stats = algo.policy_loss(logprobs, part["old_logprobs"], part["advantages"], mask,
                                                 settings.clip_eps, normalizer)
            if grpo:
                kl = algo.kl_penalty(logprobs, part["ref_logprobs"], settings.kl_estimator)
                aux = algo.token_average(kl, mask, normalizer) if kl_coef else logprobs.new_zeros(())
                loss = pg_loss + kl_coef * aux
            else:
                aux = algo.value_loss(values.float(), part["old_values"], part["returns"], mask,
                                      settings.value_clip, normalizer)
                loss = pg_loss + settings.vf_coef * aux
            engine.backward(loss)
        step["policy_loss"] += pg_loss.item() / accum
        step["kl_loss" if grpo else "value_loss"] += aux.item() / accum
        step["entropy"] += algo.masked_mean(entropy, mask).item() / accum
        for k in ("clip_frac", "approx_kl"):
            step[k] += pg_stats[k] / accum
    step["grad_norm"] = engine.step()
    return step


def update(cfg, engine: Engine, batch: dict, seed: int, kl_coef: float, amp) -> dict:
    """PPO epochs over seeded minibatches of the global batch; each rank takes its slice of every minibatch."""
    settings, world, rank = cfg.ppo, dist.world_size(), dist.rank()
    total = batch["responses"].shape[0]
    per_rank = settings.minibatch_size // world
    engine.model.train()
    sums: dict[str, float] = {}
    minibatches, epochs_run = 0, 0
    group = settings.group_size if settings.algorithm == "grpo" and settings.group_minibatches else 1
    with adapter_fused(engine.model.lm):  # LoRA as one matmul per layer where it can be (CPU, fp32)
        for epoch in range(settings.ppo_epochs):
            order = minibatch_order(total, group, seed * 31 + epoch)
            epoch_kl = []
            for start in range(0, total, settings.minibatch_size):
                chosen = order[start : start + settings.minibatch_size]
                # Gradient = sum over the minibatch's tokens / their count, whatever the split (DDP averages over ranks
                # and the engine over micro-batches, hence the factor).
                normalizer = batch["mask"][chosen].sum().item() / (world * settings.grad_accum_steps)
                step = minibatch_step(settings, engine, batch, chosen[rank * per_rank : (rank + 1) * per_rank],
                                      normalizer, kl_coef, amp)
                epoch_kl.append(step["approx_kl"])
                for k, v in step.items():
                    sums[k] = sums.get(k, 0.0) + v
                minibatches += 1
            epochs_run += 1
            if (settings.target_kl is not None
                    and dist.all_reduce_mean({"kl": sum(epoch_kl) / len(epoch_kl)})["kl"] > settings.target_kl):
                break  # the policy moved far enough from the rollout policy for this batch (every rank agrees)
    return {**{k: v / minibatches for k, v in sums.items()}, "ppo_epochs_run": epochs_run}


@torch.no_grad()
def sync_actor(actor: nn.Module, learner: nn.Module) -> None:
    """Copy the learner's trainable weights into the rollout actor (frozen base weights are shared values already)."""
    for a, p in zip(actor.parameters(), learner.parameters()):
        if p.requires_grad:
            a.copy_(p)


def micro_batch_rows(settings) -> int:
    """Rows per forward and backward on one rank: its share of a minibatch, split over grad_accum_steps."""
    return settings.minibatch_size // dist.world_size() // settings.grad_accum_steps


def make_engine(cfg, policy: PolicyWithValue, device) -> Engine:
    """The policy's optimizer engine as ppo.* configures it (DDP or ZeRO, accumulation, constant or annealed LR)."""
    settings = cfg.ppo
    steps_per_iteration = settings.ppo_epochs * (settings.rollout_batch_size // settings.minibatch_size)
    return Engine(policy, strategy=settings.strategy, zero_stage=settings.zero_stage, optimizer=settings.optimizer,
                  lr=settings.lr, weight_decay=0.0, grad_clip=settings.grad_clip, accum_steps=settings.grad_accum_steps,
                  micro_batch=micro_batch_rows(settings), warmup_steps=0,
                  total_steps=settings.iterations * steps_per_iteration if settings.anneal_lr else None, device=device)


def reward_model_dir(ctx: StageContext) -> Path:
    """train_rm's reward model, or its distilled student (ppo.reward_model)."""
    path = model_dir(ctx, "train_rm", "model")
    if ctx.cfg.ppo.reward_model == "teacher":
        return path
    if not (path / "student" / "config.json").exists():
        raise UserError("ppo.reward_model=student, but train_rm exported no student: re-run train_rm with "
                        "train_rm.student.layers set")
    return path / "student"


def prompts_per_iteration(settings) -> int:
    """Prompts one iteration samples, over all ranks: ppo.rollout_batch_size, or its groups under GRPO."""
    return settings.rollout_batch_size // (settings.group_size if settings.algorithm == "grpo" else 1)


class Rollouts:
    """Iteration `it`'s rollout on this rank: its slice of a seeded global batch of prompts. Asynchronous
    (`ppo.async_rollout`): an actor copy generates iteration it+1 with the weights from before update it, in a thread,
    while the learner trains on iteration it; PPO's ratio to the rollout log-probs corrects the one step."""

    def __init__(self, cfg, engine: Engine, tokenizer, reference_logprobs, reward_fn, prompts: list[dict], amp):
        settings = cfg.ppo
        self.cfg, self.engine, self.prompts, self.amp = cfg, engine, prompts, amp
        self.tokenizer, self.reference_logprobs, self.reward_fn = tokenizer, reference_logprobs, reward_fn
        self.order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        self.per_iteration = prompts_per_iteration(settings)
        self.actor = self.stream = self.pool = self.pending = None
        if settings.async_rollout:
            from concurrent.futures import ThreadPoolExecutor

            self.actor = copy.deepcopy(engine.model).eval().requires_grad_(False)
            self.stream = torch.cuda.Stream() if engine.device.type == "cuda" else None
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")

    def _collect(self, it: int, model, kl_coef: float):
        rank, local = dist.rank(), self.per_iteration // dist.world_size()
        start = (it * self.per_iteration) % len(self.prompts)
        global_ids = [self.order[(start + k) % len(self.prompts)] for k in range(self.per_iteration)]
        mine = [self.prompts[i] for i in global_ids[rank * local : (rank + 1) * local]]
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            return rollout(self.cfg, model, self.reference_logprobs, self.tokenizer, self.reward_fn, mine,
                           seed=self.cfg.seed * 1_000_003 + it * 1009 + rank, device=self.engine.device,
                           kl_coef=kl_coef, amp=self.amp)

    def get(self, it: int, kl_coef: float):
        if self.actor is None:
            return self._collect(it, self.engine.model, kl_coef)
        if self.pending is None:  # the first iteration (or the first after a resume): nothing generated ahead yet
            sync_actor(self.actor, self.engine.model)
            self.pending = self.pool.submit(self._collect, it, self.actor, kl_coef)
        result = self.pending.result()
        sync_actor(self.actor, self.engine.model)  # the weights before this update generate the next batch
        more = it + 1 < self.cfg.ppo.iterations
        self.pending = self.pool.submit(self._collect, it + 1, self.actor, kl_coef) if more else None
        return result

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def iteration(cfg, engine: Engine, rollouts: Rollouts, controller, it: int, amp) -> dict:
    """One iteration: rollout, gather over ranks, whiten, update, adapt the KL coefficient; returns its metrics row."""
    settings = cfg.ppo
    t_iter = clock()
    batch, stats, timings = rollouts.get(it, controller.value)
    with phase("update", timings):
        batch = whiten_advantages(cfg, gather_batch(batch, rollouts.tokenizer.pad_token_id))
        train_stats = update(cfg, engine, batch, seed=cfg.seed + it, kl_coef=controller.value, amp=amp)
    timings["iteration_s"] = clock() - t_iter
    row = {"iteration": it + 1, **dist.all_reduce_mean({**stats, **train_stats}), "kl_coef": controller.value,
           "samples_per_s": settings.rollout_batch_size / timings["iteration_s"], **timings}
    norm = ("grad_norm",) if engine.strategy != "deepspeed" else ()  # DeepSpeed may report none (NaN) by design
    refuse_diverged(row, ("reward_raw", "score", "kl", "policy_loss", "value_loss", "kl_loss", "entropy", *norm),
                    f"{settings.algorithm} diverged at iteration {it + 1}", "lower ppo.lr or ppo.kl_coef (or the "
                    "reward's scale: ppo.reward_clip), then run it again")
    if "kl" in row:  # a coefficient that adapts always has a reference
        controller.update(row["kl"], settings.rollout_batch_size)
    if it == 0 and dist.rank() == 0:
        flat = settings.rollout_batch_size // dist.world_size() > 1 and flat_reward_warning(  # a row's std: 0
            settings.algorithm, row["reward_std"], settings.rollout_batch_size)
        for warning in (flat, saturated_sampling_warning(settings.algorithm, row["entropy"], settings.temperature)):
            if warning:
                print(warning, flush=True)
    return row


def run(ctx: StageContext) -> dict:
    cfg, settings = ctx.cfg, ctx.cfg.ppo
    rank, world, device = dist.setup()
    settings.check_processes(world)
    torch.manual_seed(cfg.seed)
    amp = autocast(device.type == "cuda" and settings.strategy == "ddp")  # DeepSpeed runs bf16 itself

    tokenizer, policy, reference_logprobs = build_policy(cfg, device)
    reward_fn = (reward_scorer(reward_model_dir(ctx), settings.reward_inputs, tokenizer, device)
                 if settings.reward == "reward_model" else judge_scorer(cfg))
    engine = make_engine(cfg, policy, device)
    adaptive = settings.adaptive_kl_target is not None and settings.algorithm == "ppo"
    controller = (algo.AdaptiveKLController(settings.kl_coef, settings.adaptive_kl_target,
                                            settings.adaptive_kl_horizon)
                  if adaptive else algo.FixedKLController(settings.kl_coef))
    checkpoints = Checkpoints(ctx.url, ctx.config_hash, keep=settings.keep_checkpoints)
    state = checkpoints.restore(engine) or {"iteration": 0, "rows": [], "kl_coef": settings.kl_coef}
    controller.value, rows = state["kl_coef"], state["rows"]
    metrics = Tracker(ctx, enabled=rank == 0, resume_step=state["iteration"],
                      restored_rows=[(row["iteration"], row) for row in rows])

    rollouts = Rollouts(cfg, engine, tokenizer, reference_logprobs, reward_fn, split(cfg.data, "train"), amp)
    bar = progress(range(state["iteration"], settings.iterations), desc=settings.algorithm, unit="iter",
                   disable=rank != 0, initial=state["iteration"], total=settings.iterations)
    for it in bar:
        row = iteration(cfg, engine, rollouts, controller, it, amp)
        rows.append(row)
        metrics.log(it + 1, row)
        bar.set_postfix(reward=f"{row['reward_raw']:.2f}", **({"kl": f"{row['kl']:.2f}"} if "kl" in row else {}))
        if settings.checkpoint_every and (it + 1) % settings.checkpoint_every == 0 and it + 1 < settings.iterations:
            checkpoints.save(engine, it + 1, {"iteration": it + 1, "rows": rows, "kl_coef": controller.value})
            faults.maybe_kill("ppo", it + 1, rank)
    rollouts.close()

    result = None
    with engine.full_parameters():  # ZeRO-3: every rank takes part in gathering the weights
        if rank == 0:
            result = export(ctx, engine.model, tokenizer, rows, metrics)
    dist.teardown()
    return result


def export(ctx: StageContext, policy: PolicyWithValue, tokenizer, rows: list[dict], metrics: Tracker) -> dict:
    """The LoRA adapter, the merged Hugging Face policy, metrics, TensorBoard logs and the reward/KL plot."""
    settings = ctx.cfg.ppo
    out = Path(tempfile.mkdtemp(prefix="rlaif-ppo-"))
    try:  # the merged weights and the adapter are large: never left behind
        (out / "reward_kl.png").write_bytes(report.ppo_curves(rows))
        lm = policy.lm
        if settings.lora_rank > 0:
            # The base model as the user named it (a hub model by repo id and revision), not this machine's cache.
            adapter = lm.peft_config["default"]
            adapter.base_model_name_or_path, adapter.revision = card.base_model_id(ctx.cfg.policy.model)
            # peft keeps the layer names as a set, saved in hash order: sorted, the file is the same on every run
            if isinstance(adapter.target_modules, set):
                adapter.target_modules = sorted(adapter.target_modules)
            # the adapter only: the vocabulary is never resized, so no embedding copy (and no peft warning that
            # it cannot find the base model's config under its builtin: name)
            save_model(lm, out / "adapter", save_embedding_layers=False)
            card.write(out / "adapter", card.policy_card(ctx, rows, adapter=True))
            lm = lm.merge_and_unload()
        save_model(lm, out / "policy")
        save_tokenizer(tokenizer, out / "policy")
        card.write(out / "policy", card.policy_card(ctx, rows, adapter=False))
        files = storage.upload_dir(out, ctx.url) + metrics.publish((out / "policy" / "README.md",))
        first, last = rows[0], rows[-1]
        summary = {"algorithm": settings.algorithm, "reward": settings.reward, "iterations": settings.iterations,
                   "reward_first": first["reward_raw"], "reward_last": last["reward_raw"], "kl_last": last.get("kl"),
                   "world_size": dist.world_size(),
                   "seconds_per_iteration": sum(r["iteration_s"] for r in rows) / len(rows),
                   "phase_seconds": {f"{name}_s": sum(r[f"{name}_s"] for r in rows) for name in RL_PHASES},
                   **phase_peaks(rows, RL_PHASES), **process_peaks()}
        kl = f"KL {last['kl']:.3f}" if "kl" in last else "no reference (kl_coef 0)"
        print(f"{settings.algorithm}: reward {first['reward_raw']:.3f} -> {last['reward_raw']:.3f}, {kl}, "
              f"{summary['seconds_per_iteration']:.2f}s/iteration")
        return ctx.commit(files=files, num_samples=settings.iterations * settings.rollout_batch_size, summary=summary)
    finally:
        shutil.rmtree(out, ignore_errors=True)

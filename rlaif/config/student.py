"""train_rm.student: a distilled reward model for PPO to score with (issue: reward scoring was 35% of an iteration)."""
from __future__ import annotations

from pydantic import Field

from rlaif.config.base import Strict, Temperature


class StudentConfig(Strict):
    """A smaller reward model trained on the teacher's scores: the trained reward model cut to its first `layers`
    transformer layers (initialised from the teacher's weights), fitted to the teacher's scores of the labeled
    responses and of responses the starting policy samples for PPO's training prompts (the distribution PPO will
    score). train_rm exports it beside the teacher with its agreement on held-out prompts; `ppo.reward_model:
    student` scores rollouts with it."""

    layers: int = Field(0, ge=0, le=1024)
    """Transformer layers the student keeps (fewer than the teacher's); 0: no student (the default)."""
    max_length: int | None = Field(None, ge=8, le=1_000_000)
    """Tokens of (prompt, response) the student sees; None: the teacher's train_rm.max_length."""
    epochs: int = Field(2, ge=1, le=1000)
    """Passes over the distillation set."""
    lr: float = Field(2e-4, gt=0, le=1)
    """Peak learning rate (AdamW, linear warm-up over 10% of the steps, then linear decay)."""
    batch_size: int = Field(32, ge=2, le=65536)
    """Responses per optimizer step, global (split across processes); the ranking term compares the pairs within
    each process's share."""
    policy_samples: int = Field(2, ge=0, le=64)
    """Responses sampled from the starting policy per PPO training prompt (each with its own seed); 0: the labeled
    responses only."""
    max_prompts: int | None = Field(2048, ge=1, le=10_000_000)
    """PPO training prompts to sample for (None: all)."""
    temperature: Temperature = Field(0.7, gt=0, le=100)
    """Sampling temperature of those responses (PPO's rollout default)."""
    max_new_tokens: int = Field(40, ge=1, le=32768)
    """Longest sampled response (PPO's rollout default)."""
    ranking_weight: float = Field(3.0, ge=0, le=1000)
    """Weight of the pairwise ranking loss next to the MSE to the teacher's scores (both in units of the teacher's
    score std): PPO uses how scores order and space responses more than their offset."""
    held_out_fraction: float = Field(0.1, gt=0, lt=1)
    """Prompts held out (by a hash of the prompt) to measure the student's agreement with the teacher."""

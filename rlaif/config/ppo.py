"""ppo: the PPO / GRPO stage's settings (rollout, update, KL control, reward source, checkpoints)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlaif.config.base import Strict, Temperature, processes, runtime_field, without
from rlaif.errors import UserError

# Processes: one per GPU on GPU machines, else ppo.nproc (or train_rm.nproc)
WORLD_FIX = f"change it, or {processes('ppo')}"


class PPOConfig(Strict):
    nproc: int = Field(2, ge=1, le=512)
    """Processes per node under torchrun on CPU. On a machine with GPUs, one process per visible GPU instead. Part
    of the cache key: each process samples its slice of the rollout from its own seed."""
    nodes: int = Field(1, ge=1, le=1024)
    """Nodes on a cluster. More than 1 runs the stage as a Kubeflow TrainJob (or PyTorchJob) of that many pods,
    created and watched by the pipeline step; locally it is refused."""
    algorithm: Literal["ppo", "grpo"] = "ppo"
    """`ppo`: clipped PPO with a value head on the policy's backbone, GAE, KL penalty in the reward. `grpo`: several
    samples per prompt, advantages relative to the prompt's group, no critic, KL as a loss term (DeepSeekMath)."""
    group_size: int = Field(4, ge=2, le=1024)
    """GRPO: samples per prompt (rollout_batch_size counts samples, so it must be a multiple of this per process)."""
    group_minibatches: bool = True
    """GRPO: minibatches of whole groups, so the packed forward runs a prompt once for its samples (where each
    process's micro-batch, minibatch_size / processes / grad_accum_steps, is a multiple of group_size; otherwise a group
    may span micro-batches and shares less); false draws samples one by one across minibatches (TRL's order)."""
    iterations: int = Field(40, ge=1, le=10_000_000)
    """Rollout + update iterations."""
    rollout_batch_size: int = Field(64, ge=1, le=1_000_000)
    """Sequences per iteration, global (split across processes)."""
    minibatch_size: int = Field(16, ge=1, le=1_000_000)
    """Sequences per optimizer step, global. Minibatches are drawn from the whole gathered rollout, so the update
    is the same for any number of processes."""
    grad_accum_steps: int = Field(1, ge=1, le=4096)
    """Micro-batches per optimizer step on each process (minibatch_size / processes / this sequences each)."""
    strategy: Literal["ddp", "deepspeed"] = "ddp"
    """DDP, or DeepSpeed ZeRO (the `deepspeed` extra) for the policy and value head."""
    zero_stage: Literal[2, 3] = 2
    """ZeRO stage when strategy is deepspeed."""
    async_rollout: bool = False
    """Generate the next rollout in a background thread, with an actor copy of the policy holding the weights from
    before the current update, while the current update trains (one step off-policy; the PPO ratio to the rollout
    log-probs corrects it). Costs a second copy of the policy. A resumed run regenerates its first batch on-policy."""
    target_kl: float | None = Field(None, gt=0, le=1e6)
    """Stop an iteration's remaining PPO epochs when an epoch's mean approximate KL to the rollout policy exceeds
    this (checked between epochs: needs ppo_epochs 2 or more)."""
    ppo_epochs: int = Field(2, ge=1, le=100)
    """Passes over each rollout (TRL: 4, OpenRLHF/verl: 1)."""
    lr: float = Field(1e-3, gt=0, le=1)
    """Learning rate of the trainable policy parameters and the value head."""
    optimizer: Literal["adamw", "adafactor", "adamw_8bit"] = "adamw"
    """`adamw`: two fp32 moments per trained weight, 8 bytes. `adafactor` (transformers' Adafactor at this lr, no
    first moment): a matrix keeps one row and one column of second moments; pick it for full-weight PPO (lora_rank 0)
    of a policy whose optimizer state does not fit, and expect to tune lr. Under DeepSpeed ZeRO it sees flat
    partitions: 4 bytes per weight, and steps unlike DDP's. `adamw_8bit` (bitsandbytes, the `bnb` extra; on CPUs
    version 0.50 or later): both moments in 8 bits, 2 bytes per weight. With LoRA (the default) the state is small
    whichever it is."""
    lora_rank: int = Field(16, ge=0, le=4096)
    """LoRA rank; 0 trains all weights (and keeps a frozen reference copy)."""
    lora_alpha: int = Field(32, ge=1, le=65536)
    """LoRA scaling numerator."""
    max_new_tokens: int = Field(40, ge=1, le=32768)
    """Longest response during rollout."""
    fixed_length: bool = False
    """Roll out exactly max_new_tokens tokens per response, EOS barred until then (TRL's PPOTrainer generates so,
    with min_new_tokens = response_length): every sequence is scored at its last token. For benchmarks against
    such trainers; off, a response ends at its EOS."""
    rollout_logprobs: Literal["auto", "sampled", "recompute"] = "auto"
    """Where the rollout's old log-probs and values come from. `sampled`: the hidden states the sampler computed for
    each token (one policy forward fewer per iteration); `recompute`: a forward over the finished rollout (TRL,
    OpenRLHF, verl). `auto`: sampled in fp32 (CPUs), where the two agree to float rounding, recomputed under bf16
    (GPUs), where they differ more and keeping the hidden states would cost the decoder its CUDA graph (measured in
    BENCHMARKS.md). Models
    whose logits are not a plain head over the last hidden state always recompute."""
    temperature: Temperature = Field(0.7, gt=0, le=100)
    """Rollout sampling temperature; log-probs are taken at the same temperature (TRL's default, 0.7, and the
    evaluation's). At 1.0 a small policy's long answers come out garbled often enough that PPO settles on a short,
    reliable reply instead (measured in BENCHMARKS.md)."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount (all peers use 1.0)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda (TRL, DeepSpeed-Chat, NeMo: 0.95; OpenRLHF, verl: 1.0)."""
    clip_eps: float = Field(0.2, gt=0, le=10)
    """Policy ratio clip."""
    value_clip: float = Field(0.2, gt=0, le=1e6)
    """Value clip around the rollout values."""
    vf_coef: float = Field(0.1, ge=0, le=1e6)
    """Value-loss weight (TRL: 0.1)."""
    kl_coef: float = Field(0.05, ge=0, le=3.4e38)  # float32: a huge one diverges, which ppo refuses
    """PPO: weight of the per-token KL penalty in the reward (peers: 0.001 to 0.1). GRPO: weight of the KL loss term
    (TRL's GRPO default is 0). 0: no reference at all (no reference pass per rollout, no frozen copy of an
    all-weights policy), and the KL to it is not logged. With adaptive_kl_target, the coefficient it starts from."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator (PPO peers use k1 in the reward; GRPO uses k3 in the loss)."""
    adaptive_kl_target: float | None = Field(None, gt=0, le=1e6)
    """PPO: adapt kl_coef so the per-sequence KL tracks this target (Ziegler et al.); None keeps kl_coef fixed."""
    adaptive_kl_horizon: int = Field(10000, ge=1, le=1_000_000_000)
    """PPO: horizon (in sequences) of the adaptive KL controller."""
    reward: Literal["reward_model", "judge"] = "reward_model"
    """`reward_model`: the stage-3 reward model's normalised score. `judge` (d-RLAIF, Lee et al. 2023): label's judge
    scores each response alone in [-1, 1] (judges hf and rules) against a principle sampled per prompt; no reward
    model in the loop (stage 3 still runs, and evaluation still reports its score)."""
    reward_model: Literal["teacher", "student"] = "teacher"
    """With reward reward_model: score rollouts with the trained reward model (`teacher`) or its distilled student
    (`student`, needs train_rm.student.layers > 0): a fraction of the scoring time, agreement in train_rm's summary."""
    reward_inputs: Literal["auto", "token_ids", "text"] = "auto"
    """How rollouts reach the reward model. `token_ids`: the policy's sampled tokens go in as they are, in the reward
    model's pair template (no decode and re-tokenize; needs the reward model's tokenizer to be the policy's). `text`:
    responses are decoded and re-tokenized. `auto`: token ids when the tokenizers are the same. Sampled tokens can
    split a text differently from re-tokenizing it (BENCHMARKS.md measures how often)."""
    reward_clip: float = Field(5.0, gt=0, le=1e6)
    """Clip normalised rewards to +-this."""
    missing_eos_penalty: float | None = Field(None, ge=0, le=1e6)
    """Subtract this from the score of a response that ran out of tokens before its EOS (TRL's option)."""
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    """Clip the global gradient norm to this."""
    anneal_lr: bool = False
    """Decay the learning rate linearly to 0 over the run (CleanRL); off keeps it constant."""
    checkpoint_every: int = runtime_field(10, ge=0, le=10_000_000)
    """Checkpoint every this many iterations (trainable weights, value head, optimizer, schedule, KL coefficient,
    metrics so far); a restarted stage resumes from the newest, exactly. 0 disables. Not part of the cache key."""
    keep_checkpoints: int = runtime_field(2, ge=1, le=10_000)
    """Checkpoints kept in storage (not part of the cache key)."""

    def cache_key_view(self, keyed: dict) -> dict:
        """Settings the chosen algorithm and options never read are left out, so changing them re-runs nothing."""
        unread = {"zero_stage"} if self.strategy == "ddp" else set()
        if self.algorithm == "grpo":  # no critic, no GAE, no adaptive KL controller
            unread |= {"gamma", "lam", "value_clip", "vf_coef", "adaptive_kl_horizon"}
        else:
            unread |= {"group_size", "group_minibatches"}
            if self.adaptive_kl_target is None:
                unread.add("adaptive_kl_horizon")
        if self.lora_rank == 0:
            unread.add("lora_alpha")
        if self.kl_coef == 0 and self.adaptive_kl_target is None:  # no reference: no KL to estimate
            unread.add("kl_estimator")
        if self.reward == "judge":  # no reward model in the loop
            unread |= {"reward_model", "reward_inputs"}
        return without(keyed, unread)

    @model_validator(mode="after")
    def _sizes(self):
        if self.rollout_batch_size % self.minibatch_size:
            raise ValueError(f"minibatch_size {self.minibatch_size} must divide "
                             f"rollout_batch_size {self.rollout_batch_size}")
        if self.fixed_length and self.missing_eos_penalty:
            raise ValueError("missing_eos_penalty would penalise every response under fixed_length (no response "
                             "ends with EOS): set one of them off")
        if self.algorithm == "grpo" and self.adaptive_kl_target is not None:
            raise ValueError("adaptive_kl_target adapts PPO's KL penalty; GRPO's KL loss weight is kl_coef, fixed: "
                             "remove adaptive_kl_target, or set algorithm ppo")
        if self.adaptive_kl_target is not None and self.kl_coef == 0:
            raise ValueError("adaptive_kl_target scales kl_coef up and down from its starting value, and from 0 it "
                             "stays 0: set kl_coef above 0 as its start (e.g. 0.05), or remove adaptive_kl_target")
        if self.target_kl is not None and self.ppo_epochs == 1:
            raise ValueError("target_kl stops an iteration's remaining PPO epochs, and with ppo_epochs 1 none remain: "
                             "set ppo_epochs 2 or more, or remove target_kl")
        if self.algorithm == "grpo" and self.rollout_batch_size % self.group_size:
            raise ValueError(f"rollout_batch_size {self.rollout_batch_size} must be a multiple of "
                             f"group_size {self.group_size}")
        return self

    def check_processes(self, world: int) -> None:
        """The batch sizes split over `world` processes; checked before a run starts (launch.prepare) and again by
        the stage, which knows the world it got."""
        samples = self.group_size if self.algorithm == "grpo" else 1
        if self.rollout_batch_size % (world * samples):
            raise UserError(f"ppo.rollout_batch_size={self.rollout_batch_size} must be divisible by {world} "
                            "processes" + (f" x group_size {samples}" if samples > 1 else "") + f": {WORLD_FIX}")
        if self.minibatch_size % (world * self.grad_accum_steps):
            raise UserError(f"ppo.minibatch_size={self.minibatch_size} must be divisible by {world} processes x "
                            f"grad_accum_steps {self.grad_accum_steps}: {WORLD_FIX} (or grad_accum_steps)")
        if self.async_rollout and self.strategy != "ddp":
            raise UserError("ppo.async_rollout needs strategy ddp (an actor copy of sharded ZeRO weights is not "
                            "supported)")

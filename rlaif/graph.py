"""THE stage graph of the pipeline: names, inputs, outputs, resources and launch argv.

Standard library only. The local runner, the KFP pipeline and the Airflow DAGs are all generated from `STAGES`;
there is no second copy of the DAG anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Resources:
    """What one stage's pod (or local process group) needs."""

    cpu: int = 2
    memory_gib: int = 8
    gpus: int = 0  # GPUs per node when running on a cluster (cluster.yaml's gpus_per_node or stages.<name> change it)
    torchrun: bool = False  # launched with `torchrun --nproc_per_node=<the stage config's nproc>` when that is > 1
    gpu_for_judge_only: bool = False  # the GPU serves only the label judge: none when the judge runs no model


@dataclass(frozen=True)
class Stage:
    name: str
    description: str
    inputs: tuple[str, ...]  # upstream stage names whose manifests this stage reads
    outputs: tuple[str, ...]  # what lands under <run_dir>/<name>/ besides manifest.json
    config_sections: tuple[str, ...]  # top-level config sections that this stage's cache key covers
    uses_prompts: bool  # the prompts file is an input (its digest is part of the cache key)
    resources: Resources = field(default_factory=Resources)
    # An input this stage can read while it is still being written (`<stage>.streaming` in the config): then
    # orchestrators start the two together instead of one after the other; they stay two steps.
    streams_from: str | None = None

    def waits_for(self, streaming: bool) -> tuple[str, ...]:
        """The inputs an orchestrator starts this stage after: all of them, less the streamed one when streaming."""
        return tuple(dep for dep in self.inputs if not (streaming and dep == self.streams_from))

    def argv(self, config_url: str, overrides: tuple[str, ...] = ()) -> list[str]:
        """The command a container (or the local runner) runs for this stage, without the torchrun prefix."""
        cmd = ["rlaif", "stage", self.name, "--config", config_url]
        for item in overrides:
            cmd += ["--set", item]
        return cmd


STAGES: tuple[Stage, ...] = (
    Stage(
        name="generate",
        description="sample a response pair per training prompt from the starting policy (ranks split the prompts)",
        inputs=(),
        outputs=("shard-*.tar (prompt.txt, response_a.txt, response_b.txt, gen.json)",),
        config_sections=("seed", "data", "policy", "generate"),
        uses_prompts=True,
        resources=Resources(cpu=4, memory_gib=16, gpus=1, torchrun=True),
    ),
    Stage(
        name="label",
        description="AI judge labels each pair with a position-debiased soft preference",
        inputs=("generate",),
        outputs=("shard-*.tar (+ label.json)",),
        config_sections=("seed", "data", "label"),  # data: the prompts' references grade the labels
        uses_prompts=True,
        resources=Resources(cpu=4, memory_gib=16, gpus=1, gpu_for_judge_only=True),
        streams_from="generate",  # label.streaming: pairs are labeled as generate's shards land
    ),
    Stage(
        name="train_rm",
        description="train the preference (reward) model on the soft labels, DDP under torchrun",
        inputs=("label",),
        outputs=("model/ (HF directory, safetensors, reward_stats.json)", "metrics.jsonl"),
        # data: the prompts' references grade the reward model; policy: its student samples the starting policy
        config_sections=("seed", "data", "policy", "train_rm"),
        uses_prompts=True,
        resources=Resources(cpu=8, memory_gib=32, gpus=1, torchrun=True),
    ),
    Stage(
        name="ppo",
        description="fine-tune the policy with PPO against the reward model, multi-process under torchrun",
        inputs=("train_rm",),
        outputs=("policy/ (merged HF directory)", "adapter/ (LoRA)", "metrics.jsonl", "reward_kl.png"),
        config_sections=("seed", "data", "policy", "label", "ppo"),  # label: its judge is the d-RLAIF reward
        uses_prompts=True,
        resources=Resources(cpu=8, memory_gib=32, gpus=1, torchrun=True),
    ),
    Stage(
        name="evaluate",
        description="tuned vs starting policy on held-out prompts: judge win rate, reward, KL, report",
        inputs=("train_rm", "ppo"),
        outputs=("metrics.json", "report.md", "report.html", "examples.jsonl"),
        config_sections=("seed", "data", "policy", "label", "evaluate"),
        uses_prompts=True,
        resources=Resources(cpu=4, memory_gib=16, gpus=1),
    ),
)

STAGE_BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}


def topological_order(stages: tuple[Stage, ...] = STAGES) -> list[Stage]:
    """Stages ordered so each comes after all of its inputs; raises on unknown inputs or cycles."""
    by_name = {s.name: s for s in stages}
    order: list[Stage] = []
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ValueError(f"cycle in stage graph: {' -> '.join(path + (name,))}")
        if name not in by_name:
            raise ValueError(f"stage {path[-1]!r} depends on unknown stage {name!r}")
        state[name] = "visiting"
        for dep in by_name[name].inputs:
            visit(dep, path + (name,))
        state[name] = "done"
        order.append(by_name[name])

    for stage in stages:
        visit(stage.name, ())
    return order


def render() -> str:
    """Human-readable DAG, printed by `rlaif graph`."""
    lines = []
    for stage in topological_order():
        r = stage.resources
        launch = "torchrun" if r.torchrun else "process"
        after = ", ".join(stage.inputs) or "(prompts)"
        lines.append(f"{stage.name:<9} <- {after:<16} [{launch}; cpu={r.cpu} mem={r.memory_gib}Gi gpu={r.gpus}]")
        lines.append(f"{'':<9}    {stage.description}")
        if stage.streams_from:
            lines.append(f"{'':<9}    with {stage.name}.streaming: starts with {stage.streams_from}, reading its "
                         "shards as they land")
    return "\n".join(lines)

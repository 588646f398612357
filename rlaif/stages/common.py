"""What every stage shares: where its output lives, its cache key, its inputs, and committing its manifest."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rlaif.config import PipelineConfig, cache_key_dump, sha256_json, stage_config_hash
from rlaif.errors import UserError
from rlaif.graph import STAGE_BY_NAME, Stage
from rlaif.io import manifest, storage, stream
from rlaif.io.digest import spec_digest
from rlaif.io.prompt_sources import reading
from rlaif.io.prompts import source_digest


def run_url(cfg: PipelineConfig) -> str:
    return storage.join(storage.normalize(cfg.storage.root), cfg.run_id)


def stage_url(cfg: PipelineConfig, name: str) -> str:
    return storage.join(run_url(cfg), name)


@dataclass
class StageContext:
    cfg: PipelineConfig
    stage: Stage
    url: str  # <root>/<run_id>/<stage>
    inputs: dict[str, dict]  # upstream stage name -> its manifest
    input_digests: dict[str, str]
    config_hash: str
    part_index: int = 0  # `rlaif stage --shard-index`: this process's part of a stage split across pods
    num_parts: int = 1  # `rlaif stage --num-shards`
    started: float = field(default_factory=time.time)  # this process's start of the stage, for the manifest's seconds
    # An upstream read while it is still being written -> the config hash its output will carry. Such a context has
    # no manifest of that upstream and no cache key yet: `resolved` gives them once the upstream has committed.
    streamed: dict[str, str] = field(default_factory=dict)
    # Streamed, but the stage's output there may still hold once the upstream commits: a launcher waits for that
    # (wait_for_upstream) instead of streaming, unless it runs the stage again anyway.
    wait_first: bool = False

    def input_url(self, name: str) -> str:
        return stage_url(self.cfg, name)

    def elapsed(self) -> float:
        return time.time() - self.started

    def commit(self, **fields) -> dict:
        """Write the manifest: the last write of a stage, which makes its output exist."""
        if self.streamed:
            raise RuntimeError("a streaming stage commits through resolved(ctx): its cache key needs the upstream")
        return manifest.write(
            self.url, stage=self.stage.name, run_id=self.cfg.run_id, config_hash=self.config_hash,
            inputs=self.input_digests, seconds=round(self.elapsed(), 3),
            input_config_hashes={dep: m.get("config_hash") for dep, m in self.inputs.items()}, **fields,
        )

    def write_json(self, name: str, obj) -> dict:
        data = manifest.to_json(obj)
        storage.write_bytes_atomic(storage.join(self.url, name), data)
        return {"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _judge_files(judge, setting: str) -> dict[str, tuple[str | None, str]]:
    """role -> (the config field that names it, the file or model) for a judge's files; `setting` is where the
    judge's settings live (label, evaluate.judges.N)."""
    files = {"constitution": (f"{setting}.constitution", judge.constitution)} \
        if judge.constitution and judge.reads_constitution else {}
    if judge.few_shot:
        files["few_shot"] = (f"{setting}.few_shot", judge.few_shot)
    if judge.judge == "hf":
        files["model"] = (f"{setting}.hf.model", judge.hf.model)
    if judge.judge == "embedding":
        files["model"] = (None, "builtin:minilm")
    return files


def named_files(cfg: PipelineConfig, name: str) -> dict[str, tuple[str | None, str]]:
    """role -> (config field, file or model directory) for every one the stage reads that its config names (besides
    the prompts)."""
    tiny = cfg.policy.model == "builtin:tiny-llama"
    policy = {"policy": ("policy.tiny.demonstrations", cfg.policy.tiny.demonstrations) if tiny
              else ("policy.model", cfg.policy.model)}
    label = {f"label.{role}": named for role, named in _judge_files(cfg.label, "label").items()}
    if name == "generate":
        return policy
    if name == "label":
        return label
    if name == "train_rm":
        return {"backbone": ("train_rm.backbone", cfg.train_rm.backbone)}
    if name == "ppo":
        return {**policy, **(label if cfg.ppo.reward == "judge" else {})}
    judges = {f"evaluate.{judge.name}.{role}": named for number, judge in enumerate(cfg.evaluate.judges)
              for role, named in _judge_files(judge, f"evaluate.judges.{number}").items()}
    return {**policy, **label, **judges}


def content_keyed_fields(cfg: PipelineConfig, name: str) -> list[str]:
    """The config fields whose files the stage's key holds by content, its own (file_digests) or through an upstream
    manifest's digest (each stage's digest covers its inputs' content): keyed by that alone, not by how the path is
    spelled (data/p.jsonl, ./data/p.jsonl, an absolute path, file://), so a run launched from another directory, or
    by KFP or Airflow, reuses the outputs made from the same files."""
    fields, seen, todo = [], set(), [name]
    while todo:
        stage = STAGE_BY_NAME[todo.pop()]
        if stage.name in seen:
            continue
        seen.add(stage.name)
        fields += ["data.prompts"] if stage.uses_prompts else []
        fields += [field for field, _ in named_files(cfg, stage.name).values() if field]
        todo += list(stage.inputs)
    return sorted(set(fields))


def file_digests(cfg: PipelineConfig, name: str) -> dict[str, str]:
    """Content digests of the prompts (where the stage reads them; s3:// objects, dataset directories, globs and hub
    datasets included) and of every file its config names (local or s3://)."""
    digests = {"prompts": source_digest(cfg.data), "prompts_read_as": reading(cfg.data)} \
        if STAGE_BY_NAME[name].uses_prompts else {}
    return {**digests, **{f"file:{role}": spec_digest(spec, model=_names_a_model(field))
                          for role, (field, spec) in named_files(cfg, name).items()}}


def _names_a_model(field: str | None) -> bool:
    """A model directory setting (policy.model, a judge's hf.model, train_rm.backbone), which may be a hub id and
    whose weights enter the key by the large-file shortcut; not a data file (policy.tiny.demonstrations)."""
    return field is not None and field.rsplit(".", 1)[-1] in ("model", "backbone")


def context(cfg: PipelineConfig, name: str, part_index: int = 0, num_parts: int = 1,
            upstream_hashes: dict[str, str | None] | None = None) -> StageContext:
    """Reads (and so requires) the upstream manifests; raises UserError if one is missing. The cache key covers the
    upstream manifests, the content of every file the config names for this stage, and the code. `upstream_hashes`:
    the config hashes already computed in this call, so an upstream reached by two paths is hashed once."""
    stage = STAGE_BY_NAME[name]
    known = {} if upstream_hashes is None else upstream_hashes
    try:
        inputs = {dep: current_input(cfg, dep, name, known) for dep in stage.inputs}
    except StaleInput as stale:
        if stale.reader != name:
            stale.through.append(name)
        if upstream_hashes is not None or stale.reader == name:
            raise
        raise stale.seen_from(name, cfg.run_id) from None  # name the stage launched, not an edge further up
    digests = {**{dep: m["digest"] for dep, m in inputs.items()}, **file_digests(cfg, name)}
    return StageContext(cfg, stage, stage_url(cfg, name), inputs, digests,
                        stage_config_hash(cfg, stage.config_sections, digests, content_keyed_fields(cfg, name)),
                        part_index, num_parts)


def current_input(cfg: PipelineConfig, dep: str, reader: str, known: dict[str, str | None]) -> dict:
    """Upstream stage `dep`'s manifest, refused unless it was made from this config (its settings, the files it
    reads, the code, its own upstreams', recursively): one stage launched after a change would otherwise read the
    output of the old settings, and be cached under the new ones (a stale hit). `known`: hashes computed so far."""
    committed = manifest.require(stage_url(cfg, dep), dep)
    if dep not in known:
        try:
            known[dep] = context(cfg, dep, upstream_hashes=known).config_hash
        except manifest.MissingInput:  # an input of `dep` itself is gone: nothing to compare its output with
            known[dep] = None
    if known[dep] is not None and committed["config_hash"] != known[dep]:
        raise StaleInput(f"stage '{reader}' reads '{dep}', whose output in run '{cfg.run_id}' was made from other "
                         f"settings, inputs or rlaif code than this config's now: run the pipeline (`rlaif run`), or "
                         f"`rlaif launch {dep}` with this config first", dep, reader)
    return committed


class StaleInput(UserError):
    """An upstream output made from other settings than the config's now (`dep`, as read by stage `reader`)."""

    def __init__(self, message: str, dep: str, reader: str):
        super().__init__(message)
        self.dep, self.reader = dep, reader
        self.through = [reader]  # the stages between the stale output and the one launched, as the error rises

    def seen_from(self, launched: str, run_id: str) -> StaleInput:
        """The same finding told to the stage launched, several edges below the stale output."""
        path = self.through[:-1] if self.through[-1] == launched else self.through
        return StaleInput(f"stage '{launched}' depends on '{self.dep}' (through {', '.join(map(repr, path))}), whose "
                          f"output in run '{run_id}' was made from other settings, inputs or rlaif code than this "
                          f"config's now: run the pipeline (`rlaif run`), or `rlaif launch` each stage from "
                          f"'{self.dep}' to '{launched}' in order", self.dep, launched)


def start_context(cfg: PipelineConfig, name: str, part_index: int = 0, num_parts: int = 1) -> StageContext:
    """The context a stage starts with: `context`'s, or, where the stage streams an upstream (`<stage>.streaming`)
    whose output for this config is not committed yet, one without that upstream and without a cache key, so nothing
    is a cache hit: the stage follows the upstream's shards as they land (rlaif.io.stream)."""
    stage = STAGE_BY_NAME[name]
    if stage.streams_from and getattr(getattr(cfg, name), "streaming", False):
        upstream = context(cfg, stage.streams_from)
        if not cached(upstream):
            others = {dep: manifest.require(stage_url(cfg, dep), dep) for dep in stage.waits_for(streaming=True)}
            return StageContext(cfg, stage, stage_url(cfg, name), others, {}, "", part_index, num_parts,
                                streamed={upstream.stage.name: upstream.config_hash},
                                wait_first=_may_still_hold(cfg, stage, others, upstream.config_hash))
    return context(cfg, name, part_index, num_parts)


def _may_still_hold(cfg: PipelineConfig, stage: Stage, others: dict[str, dict], upstream_hash: str) -> bool:
    """Is the stage's committed output the one this config makes, should its streamed upstream, made again with the
    settings it was made with (`upstream_hash`, a --rerun), come out as before? (Its own settings, files and other
    inputs all as they were.) Where the upstream's settings changed, it cannot."""
    existing = manifest.read(stage_url(cfg, stage.name))
    if not existing or (existing.get("input_config_hashes") or {}).get(stage.streams_from) != upstream_hash:
        return False
    digests = {**{dep: m["digest"] for dep, m in others.items()},
               stage.streams_from: existing["inputs"][stage.streams_from], **file_digests(cfg, stage.name)}
    return existing["inputs"] == digests and existing["config_hash"] == stage_config_hash(
        cfg, stage.config_sections, digests, content_keyed_fields(cfg, stage.name))


def wait_for_upstream(ctx: StageContext) -> StageContext:
    """A stage whose output may still hold (`wait_first`) waits for its streamed upstream's commit instead of
    streaming it, and gets the context a sequential run computes: the cache then decides (streaming would replace
    an output that still holds when a re-run of generate samples the same pairs)."""
    print(f"[{ctx.stage.name}] its output for these settings exists: waiting for {ctx.stage.streams_from}'s output "
          "to see whether it still holds, instead of streaming it", flush=True)
    upstream_follower(ctx).wait()
    return context(ctx.cfg, ctx.stage.name, ctx.part_index, ctx.num_parts)


def upstream_follower(ctx: StageContext) -> stream.Follower:
    """The follower of a streaming context's upstream output, bounded by the stage's stream_timeout_s."""
    name = ctx.stage.name
    upstream = ctx.stage.streams_from
    return stream.Follower(stage_url(ctx.cfg, upstream), ctx.streamed[upstream],
                           getattr(ctx.cfg, name).stream_timeout_s, name, f"{name}.stream_timeout_s")


def cleared_when_streaming_starts(ctx: StageContext, shards: Iterator[dict]) -> Iterator[dict]:
    """A streamed upstream's shards, the stage's previous output removed once the first one has landed, not before:
    a stream that never comes (a launch whose settings are not the running upstream's) leaves it as it was. The
    removal happens at the first next(): the stage must write nothing of its output before it reads its input."""
    first = next(shards, None)
    clear_output(ctx)
    if first is not None:
        yield first
        yield from shards


def resolved(ctx: StageContext, committed: dict[str, dict]) -> StageContext:
    """A streaming stage's context once the upstreams it streamed have committed these manifests: inputs and cache key
    exactly as a sequential run computes them (same config hash, same manifest digest)."""
    final = dataclasses.replace(context(ctx.cfg, ctx.stage.name, ctx.part_index, ctx.num_parts), started=ctx.started)
    for name, streamed in committed.items():
        if final.inputs[name]["digest"] != streamed["digest"]:
            raise UserError(f"stage '{name}' was re-run while '{ctx.stage.name}' was streaming its output: "
                            f"re-run '{ctx.stage.name}'")
    return final


def cached(ctx: StageContext, report: bool = False) -> dict | None:
    """The existing manifest if it was made from the same config and inputs and its files are all there at their
    sizes (a cache hit), else None: a damaged output is made again (`report`: say so, once, from its launcher)."""
    existing = manifest.read(ctx.url)
    if not existing or existing["config_hash"] != ctx.config_hash or existing["inputs"] != ctx.input_digests:
        return None
    damage = manifest.damage(ctx.url, existing)
    if damage is not None:
        if report:
            print(f"[{ctx.stage.name}] its output for this config is damaged ({damage}): running it again",
                  flush=True)
        return None
    return existing


def check_inputs_whole(ctx: StageContext) -> None:
    """Every upstream output this stage reads has all its files at their recorded sizes: checked before the stage
    removes its own old output, so a stage that cannot run on a damaged input is refused with that output intact."""
    for dep, committed in ctx.inputs.items():
        if (damage := manifest.damage(ctx.input_url(dep), committed)) is not None:
            raise UserError(f"stage '{ctx.stage.name}' reads '{dep}', whose output in run '{ctx.cfg.run_id}' is "
                            f"damaged ({damage}): run it again (`rlaif run --rerun {dep}`, or `rlaif launch {dep} "
                            "--rerun`)")


LAUNCHED_CONFIG = "RLAIF_LAUNCHED_CONFIG"  # sha256 of the config text a launcher wrote for the stage it starts


def launched_config(cfg: PipelineConfig) -> str:
    """The value of LAUNCHED_CONFIG for this config: what a stage compares the run's config.yaml with. Settings of
    how stages run (cache_key_dump leaves them out) may differ: KFP's label pod adds label.streaming, and launch lets
    such a config rewrite config.yaml beside a running stage."""
    return sha256_json(cache_key_dump(cfg))


def check_launched_config(cfg: PipelineConfig) -> None:
    """The stage runs the settings its launcher checked and cached under: another launcher of the run with other
    settings can rewrite config.yaml while no stage holds its lock (between two stages of `rlaif run`), and this
    stage, which reads config.yaml, would then run those settings under the first launcher's name."""
    expected = os.environ.get(LAUNCHED_CONFIG)
    if expected and launched_config(cfg) != expected:
        raise UserError(f"the config.yaml of run '{cfg.run_id}' was rewritten with other settings by another launcher "
                        "while this run went on (between two stages): run it again with its own settings, or give the "
                        "other launch another --run-id")


FRESH_START = "RLAIF_FRESH_START"  # set by `--rerun` for the stage's processes: no resuming from a checkpoint


def clear_output(ctx: StageContext) -> None:
    """Start of a stage run: its old output stops existing before anything new is written. A run that resumes from a
    checkpoint of this config keeps the checkpoints and the attempt's metrics and tracker ids; any other start (or a
    `--rerun`, which asks for the stage to run again, not to pick up where it ended) empties the stage's directory
    but for its lock: another config's files would otherwise stay beside the new ones (a LoRA adapter next to a full
    policy, two runs' curves in one TensorBoard directory, another config's checkpoints)."""
    from rlaif.io.lock import LOCK
    from rlaif.training import Checkpoints

    manifest.invalidate(ctx.url)
    if not os.environ.get(FRESH_START) and Checkpoints(ctx.url, ctx.config_hash).latest() is not None:
        return
    entries = sorted({name.split("/", 1)[0] for name in storage.list_files(ctx.url)})
    old = [entry for entry in entries if not entry.startswith(LOCK)]  # the lock and its takeover markers stay
    if old:  # said, not silent: another config's checkpoints (a code upgrade changes the key too) go with the rest
        print(f"[{ctx.stage.name}] starting afresh: removing the previous output ({', '.join(old)})", flush=True)
    for entry in old:
        storage.remove(storage.join(ctx.url, entry), recursive=True)


def model_dir(ctx: StageContext, upstream: str, subdir: str) -> Path:
    """A verified local copy of a model directory that an upstream stage listed in its manifest."""
    m = ctx.inputs[upstream]
    files = [dict(f, path=f["path"][len(subdir) + 1:]) for f in m["files"] if f["path"].startswith(subdir + "/")]
    return storage.download_dir(storage.join(ctx.input_url(upstream), subdir), files)

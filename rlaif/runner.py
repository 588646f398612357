"""Local runner: runs the stage graph in order, each stage as its own process exactly as a container would run it
(torchrun for the training stages). Stages whose manifest matches their config and inputs are skipped (cache hits),
so re-running after a failure or a kill continues from the first incomplete stage. A stage that streams from the one
before it (label.streaming) runs at the same time as that one, each under its own `rlaif launch`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlaif.config import PipelineConfig
from rlaif.errors import StageFailed, UserError
from rlaif.graph import topological_order
from rlaif.io import manifest, storage, stream
from rlaif.io.lock import StageLock
from rlaif.io.urls import check_key_room
from rlaif.orchestration import launch, preflight
from rlaif.orchestration.parent_guard import guarded, kill_when_orphaned
from rlaif.stages import common


def run(cfg: PipelineConfig, rerun: set[str] = frozenset()) -> dict:
    """The whole graph; stages named in `rerun` run even where their output exists. The run is held from before its
    config is written to its end: a second launcher of it refuses up front, not between two of its stages."""
    preflight.check(cfg, pipeline=True)
    run_url = common.run_url(cfg)
    with StageLock(run_url, f"run '{cfg.run_id}'") as held:
        return _run_held(cfg, rerun, launch.write_config(cfg, held), run_url)


def _run_held(cfg: PipelineConfig, rerun: set[str], config_url: str, run_url: str) -> dict:
    print(f"run_dir: {run_url}", flush=True)
    check_judge_services(cfg, rerun)
    for group in launch_groups(cfg):
        run_group(cfg, group, config_url, rerun)
    result = manifest.require(storage.join(run_url, "evaluate"), "evaluate")["summary"]
    lo, hi = map(_shown, result["win_rate_ci95"])
    print(f"evaluation: win rate {_shown(result['win_rate'])} [95% CI {lo}, {hi}], length-controlled "
          f"{_shown(result['win_rate_length_controlled'])}, on {result['n_prompts']} held-out prompts; "
          f"reward {_shown(result['reward_policy_mean'])} (tuned) vs {_shown(result['reward_reference_mean'])} "
          f"(start); KL to reference {_shown(result['kl_to_reference'])}")
    for name, j in result["judges"].items():
        if name != "training":
            print(f"evaluation, judge '{name}': win rate {_shown(j['win_rate'])} "
                  f"[95% CI {_shown(j['win_rate_ci95'][0])}, {_shown(j['win_rate_ci95'][1])}]")
    report_url = storage.join(run_url, "evaluate", "report.html")
    if not storage.exists(report_url):  # a view of evaluate's files, not one of them: rebuilt when it was removed
        from rlaif import report

        report_url = report.write(run_url)
    print(f"report: {storage.browsable(report_url)}")
    return {"run_dir": run_url, "evaluation": result}


def _shown(value) -> str:
    """A metric to three decimals; n/a where it is missing (JSON null: a NaN, e.g. the KL of a policy whose
    log-probabilities are not finite)."""
    return f"{value:.3f}" if isinstance(value, (int, float)) else "n/a"


def check_judge_services(cfg: PipelineConfig, rerun: set[str]) -> None:
    """The judge services of label and evaluate, where either will run, before generate does (each stage's launch
    checks them again)."""
    from rlaif.judges import check_services

    for name in ("label", "evaluate"):
        try:
            will_run = bool(rerun) or not common.cached(common.context(cfg, name))
        except UserError:  # an upstream output not made yet
            will_run = True
        if will_run:  # evaluate's judges are label's and its own
            check_services(cfg, "evaluate")
            return


def run_group(cfg: PipelineConfig, group: list[str], config_url: str, rerun: set[str] = frozenset()) -> None:
    """One launch group: a streamed pair together while its first stage has to run, else stage by stage."""
    if len(group) > 1 and (group[0] in rerun or not common.cached(common.context(cfg, group[0]), report=True)):
        # Its old output goes before the group starts: a follower must not take an old (damaged, or rerun) manifest
        # of this config as committed, nor follow old shard records to shards the rerun is replacing.
        url = common.stage_url(cfg, group[0])
        stream.forget(url, "*")
        manifest.invalidate(url)
        launch_together(group, config_url, rerun)
    else:  # one stage, or a streamed one already done: nothing to overlap
        for name in group:
            launch.launch(cfg, name, config_url, rerun=name in rerun)


def launch_groups(cfg: PipelineConfig) -> list[list[str]]:
    """Stage names in graph order; a stage streaming from the stage before it (its `streaming` setting on), with all
    its other inputs done earlier, joins that stage's group. A group's stages start together."""
    groups: list[list[str]] = []
    for stage in topological_order():
        earlier = {name for group in groups[:-1] for name in group}
        streaming = getattr(getattr(cfg, stage.name), "streaming", False)
        if (streaming and groups and stage.streams_from == groups[-1][-1]
                and set(stage.waits_for(streaming=True)) <= earlier):
            groups[-1].append(stage.name)
        else:
            groups.append([stage.name])
    return groups


def launch_together(names: list[str], config_url: str, rerun: set[str] = frozenset(), poll_s: float = 0.5) -> None:
    """`rlaif launch` of each stage as its own process, all at once, sharing the machine's cores. When one fails the
    others are interrupted (their locks released; a streaming label would otherwise wait for shards that will never
    come) and its error is raised: its one-line user error, or StageFailed."""
    # Torch's OpenMP threads spin while they wait for work: two processes with a thread per core each spin against
    # each other (generate ran 5x slower beside label on 2 cores). Waiting passively, each process keeps every core
    # and uses the ones the other leaves idle (BENCHMARKS.md, streaming label).
    threads = {"OMP_WAIT_POLICY": "PASSIVE"}
    with tempfile.TemporaryDirectory(prefix="rlaif-together-") as tmp:
        procs: dict[str, subprocess.Popen] = {}
        try:
            for name in names:
                env = {**threads, **os.environ, "RLAIF_ERROR_FILE": str(Path(tmp) / f"{name}.err")}
                argv = guarded([sys.executable, "-m", "rlaif", "launch", name, "--config", config_url,
                                *(["--rerun"] if name in rerun else [])])
                procs[name] = subprocess.Popen(argv, env=env, start_new_session=True)  # its group: the stage too
            failed = _first_failure(procs, poll_s)
        finally:
            _interrupt(list(procs.values()))
        if failed:
            lines = launch.reported_errors(Path(tmp) / f"{failed}.err")
            if lines and procs[failed].returncode == 2:
                raise UserError(lines[0])
            raise StageFailed(failed, procs[failed].returncode, lines[0] if lines else None)


def _first_failure(procs: dict[str, subprocess.Popen], poll_s: float) -> str | None:
    """Waits until every process has ended or one has failed; the failed one's name, or None."""
    while True:
        failed = next((name for name, proc in procs.items() if proc.poll()), None)
        if failed or all(proc.returncode is not None for proc in procs.values()):
            return failed
        time.sleep(poll_s)


def _interrupt(procs: list[subprocess.Popen], grace_s: float = launch.STOP_GRACE_S + 40) -> None:
    """Ctrl-C for the still running `rlaif launch`es and their stage processes (they release their stage locks), then
    a kill. A launcher may wait its own grace for its stage before it releases its lock: this waits longer (a kill
    before the release leaves a lock that only its dead pid marks as free), for all of them at once."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_stage(cfg: PipelineConfig, name: str, part_index: int = 0, num_parts: int = 1) -> None:
    """What a container runs: one stage, skipped if its output already exists for this config and inputs. A stage
    split across pods (generate) runs part `part_index` of `num_parts`."""
    from rlaif.distributed import avoid_per_shape_attention_plans, die_with_parent, tell_deepspeed_the_device
    from rlaif.models.loading import quiet_transformers

    die_with_parent()
    kill_when_orphaned()
    tell_deepspeed_the_device()
    quiet_transformers()
    avoid_per_shape_attention_plans()
    storage.configure(cfg.storage.endpoint_url)
    if num_parts > 1 and name != "generate":
        raise UserError(f"--num-shards splits stage 'generate' only, not '{name}'")
    if not 0 <= part_index < num_parts:
        raise UserError(f"--shard-index {part_index} is outside 0..{num_parts - 1} (--num-shards {num_parts})")
    # A launcher (`rlaif launch`, `rlaif run`, a KFP or Airflow step, a TrainJob's) holds the stage's lock and checked
    # the cache for this key; `rlaif stage` started by hand is one process, and takes the lock itself.
    launched = "RLAIF_CACHE_CHECKED" in os.environ
    if not launched:
        check_by_hand(cfg, name, num_parts)
    common.check_launched_config(cfg)
    ctx = common.start_context(cfg, name, part_index, num_parts)
    first_rank = int(os.environ.get("RANK", "0")) == 0  # the process group is not up yet: torchrun's env says
    if os.environ.get("RLAIF_CACHE_CHECKED") != ctx.config_hash and common.cached(ctx):
        if first_rank:
            print(f"[{name}] cache hit: output exists for this config and inputs, skipped")
        return
    if launched:
        _run_stage_module(ctx, first_rank)
    elif num_parts > 1:  # parts of one stage run side by side by design; not beside a launcher of the whole stage
        if (holder := StageLock(ctx.url, "").live_holder()) is not None:
            raise UserError(f"stage '{name}' of run '{cfg.run_id}' is running (pid {holder['pid']} on "
                            f"{holder['host']}): wait for it to finish before running a part of it")
        _run_stage_module(ctx, first_rank)
    else:
        with StageLock(ctx.url, f"stage '{name}' of run '{cfg.run_id}'"):
            if launch.cache_hit(ctx, report=False) is not None:  # another launcher finished it meanwhile
                return
            _run_stage_module(ctx, first_rank)


def _run_stage_module(ctx, first_rank: bool) -> None:
    import importlib

    module = importlib.import_module(f"rlaif.stages.{ctx.stage.name}")
    common.check_inputs_whole(ctx)
    if hasattr(module, "invalidate"):  # a stage split into parts removes only its own part's output
        module.invalidate(ctx)
    elif first_rank and not ctx.streamed:  # a streaming stage clears once its stream starts (label.pair_shards)
        common.clear_output(ctx)
    module.run(ctx)


def check_by_hand(cfg: PipelineConfig, name: str, num_parts: int) -> None:
    """`rlaif stage` started by hand (not by a launcher) is one process: the stage's lock is taken by it alone, and a
    stage whose config runs several (each rank samples or draws dropout from its own seed, so the count is part of
    its cache key) would file one process's output under their key."""
    from rlaif.graph import STAGE_BY_NAME

    check_key_room(storage.normalize(cfg.storage.root), cfg.run_id)  # a launcher's preflight checks it otherwise
    world = os.environ.get("WORLD_SIZE", "1")
    world = int(world) if world.isdigit() else 1  # one that is not a count: the process group's start names it
    if world > 1 and "RANK" in os.environ:  # (WORLD_SIZE alone, left in the environment: the process group says so)
        raise UserError(f"`rlaif stage {name}` runs under a torchrun of its own here ({world} processes): start it "
                        f"with `rlaif launch {name}`, which runs torchrun itself and holds the stage's lock")
    stage, settings = STAGE_BY_NAME[name], getattr(cfg, name)
    if not stage.resources.torchrun or num_parts > 1:
        return
    nodes, gpus = getattr(settings, "nodes", 1), preflight.gpu_count()
    expected = preflight.processes_per_node(stage, cfg) * nodes
    if expected != 1:
        why = f"one per GPU, {gpus} here" if gpus else f"{name}.nproc={settings.nproc}"
        why += f" x {name}.nodes={nodes}" if nodes > 1 else ""
        other = f", or set {name}.nproc=1" if not gpus and nodes == 1 else ""
        raise UserError(f"stage '{name}' runs as {expected} processes ({why}) and `rlaif stage` by hand is one: start "
                        f"it with `rlaif launch {name}`, which runs them under torchrun{other}")

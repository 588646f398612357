"""Launching one stage, the same way for every orchestrator: the local runner, a KFP component, an Airflow task
and a Kubernetes pod all end here. A stage whose output already exists for its config and inputs is a cache hit;
a training stage runs under torchrun (one process per GPU, or the config's nproc on CPU); a stage with nodes > 1
becomes a Kubeflow TrainJob/PyTorchJob that this process creates and waits for."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlaif import scratch
from rlaif.config import (
    PipelineConfig,
    cache_key_dump,
    dump_config,
    load_config,
    parse_config,
    safe_run_id,
)
from rlaif.errors import StageFailed, UserError, ending
from rlaif.graph import STAGE_BY_NAME, Stage
from rlaif.io import manifest, storage
from rlaif.io.lock import StageLock, live_holders
from rlaif.orchestration import jobs
from rlaif.orchestration.parent_guard import LAUNCHER_PID, STOP_GRACE_S, guarded
from rlaif.orchestration.preflight import check, check_label_pod, processes_per_node
from rlaif.stages import common


def load_config_source(source: str | None, overrides: list[str] = (), run_id: str = "",
                       storage_root: str = "") -> PipelineConfig:
    """`source` is a config path/URL, or the YAML itself when it spans lines (how KFP and Airflow users paste one)
    or is a JSON object (how a pipeline compiled for a config carries it);
    `run_id` and `storage_root`, when given, override the config's."""
    # JSON-quoted: a run id such as 20240101 or true stays a string when the override is read as YAML
    overrides = [*overrides, *[f"run_id={json.dumps(run_id)}"] * bool(run_id),
                 *[f"storage.root={json.dumps(storage_root)}"] * bool(storage_root)]
    if source is not None and not source.strip():  # a KFP or Airflow field cleared: not the defaults, unasked
        raise UserError("the config is empty: name a YAML config file (e.g. configs/demo.yaml) or paste its text")
    if source and inline_config(source):
        return parse_config(source, "inline config", overrides, given=True)
    return load_config(source.strip() if source else None, overrides)


def inline_config(source: str) -> bool:
    """Is `source` the YAML itself (it spans lines, or is one line of JSON) rather than a path or URL? A path pasted
    with a line break after it is still a path."""
    text = source.strip()
    if "\n" in text or text.startswith("{"):
        return True
    path_like = re.match(r"[a-z][a-z0-9+.-]*://", text, re.I) or re.search(r"\.(ya?ml|json)$", text, re.I)
    return "\n" in source and not (path_like or _exists(text))


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


def orchestrated_run_id(overrides: list[str], run_id: str, default_run_id: str) -> str:
    """The run id a launcher passes on: the user's (--run-id, or a run_id among their overrides, which the config
    then keeps), else the orchestrator's run name (a KFP run, an Airflow DAG run), made a valid run id."""
    if run_id or any(item.partition("=")[0].strip() == "run_id" for item in overrides):
        return run_id
    return safe_run_id(default_run_id) if default_run_id else ""


def prepare(cfg: PipelineConfig, pipeline: bool = False, launched: str | None = None) -> str:
    """Cheap checks before any work, then the resolved config written once per run; returns its URL."""
    check(cfg, pipeline, launched)
    return write_config(cfg)


def write_config(cfg: PipelineConfig, holding: StageLock | None = None) -> str:
    """The resolved config written once per run (refused while another launcher runs the run with other settings;
    `holding`: the run's lock, which this launcher holds); returns its URL."""
    config_url = storage.join(storage.normalize(cfg.storage.root), cfg.run_id, "config.yaml")
    text = dump_config(cfg).encode()
    written = storage.read_bytes(config_url) if storage.exists(config_url) else None
    if written != text:
        if written is not None and other_outputs(written, cfg):  # a run without its config.yaml has not started
            refuse_while_running(cfg, holding)
        storage.write_bytes_atomic(config_url, text)
    return config_url


def other_outputs(written: bytes, cfg: PipelineConfig) -> bool:
    """The run's config.yaml names settings that make other outputs than `cfg`'s (runtime settings such as
    label.streaming, which one launcher of a streaming pipeline sets for its stage alone, do not count)."""
    try:
        before = parse_config(written.decode(), "the run's config.yaml")
    except (UserError, UnicodeDecodeError):
        return True
    return cache_key_dump(before) != cache_key_dump(cfg)


def refuse_while_running(cfg: PipelineConfig, holding: StageLock | None = None) -> None:
    """A run's config.yaml is read by each of its stages as it starts: rewritten while another launcher runs the
    run, that run's later stages would take these settings. Refused while the run (`rlaif run`, between its stages
    too) or any stage of it is held."""
    for what, holder in live_holders(common.run_url(cfg), STAGE_BY_NAME):
        if holding is None or holder["token"] != holding.token:
            raise UserError(f"run '{cfg.run_id}' is running with other settings ({what}, pid {holder['pid']} on "
                            f"{holder['host']}): wait for it to finish, or use another --run-id")


def command(stage: Stage, config_url: str, nproc: int) -> list[str]:
    """graph.py's argv, with this interpreter as `rlaif` and torchrun in front for the training stages. A stage of one
    process runs without torchrun, whose agent would cost a process that imports torch (seconds) and a rendezvous for
    a group of one; the stage runs the same either way (rlaif.distributed)."""
    argv = [sys.executable, "-m", "rlaif", *stage.argv(config_url)[1:]]
    if stage.resources.torchrun and nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv[1:]]
    return argv


# torchrun's own report of a failed rank starts here
TORCHRUN_FAILURE = b"torch/distributed/elastic/multiprocessing/api.py"
# and lists each failed rank with its exit code (negative: the signal that killed it)
FAILURE = re.compile(rb"rank\s*:\s*(\d+) \(local_rank.*?exitcode\s*:\s*(-?\d+)", re.S)
ROOT_CAUSE = b"Root Cause (first observed failure):"


def root_cause(agent_report: bytes) -> tuple[int, int] | None:
    """The rank whose failure ended the stage, and its exit code, from torchrun's report. torchrun's root cause is
    the earliest failure in whole seconds, ties in rank order: a peer that failed on the lost connection can come
    before the rank that was killed, so a rank killed by a signal (not the agent's own SIGTERM to the others) wins."""
    listed = agent_report.find(b"Failures:")
    failures = [(int(rank), int(code)) for rank, code in FAILURE.findall(agent_report[max(listed, 0):])]
    root = FAILURE.search(agent_report, agent_report.find(ROOT_CAUSE)) if ROOT_CAUSE in agent_report else None
    first = (int(root[1]), int(root[2])) if root else None
    killed = [failure for failure in failures if failure[1] < 0 and failure[1] != -signal.SIGTERM]
    return killed[0] if killed and first not in killed else first


def run_relaying_stderr(cmd: list[str], env: dict) -> tuple[int, bytes]:
    """Runs cmd, passing its stderr through as it comes (progress bars included) up to torchrun's failure report,
    which is held back and returned: after a user error it is noise around a one-line message."""
    proc = subprocess.Popen(guarded(cmd), env=env, stderr=subprocess.PIPE)
    try:
        return _relay(proc)
    finally:  # interrupted or terminated: the stage ends before this launcher does (and releases its lock)
        stop(proc)


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to a child still running (torchrun passes it to its ranks), SIGKILL after grace_s (inside a pod's
    default 30 s termination grace, so the lock is released before the kubelet kills the launcher)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _relay(proc: subprocess.Popen) -> tuple[int, bytes]:
    out, pending, held = sys.stderr.buffer, b"", []
    for chunk in iter(lambda: os.read(proc.stderr.fileno(), 65536), b""):
        if held:
            held.append(chunk)
            continue
        pending += chunk
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1  # whole lines (or bar updates) only
        ready, pending = pending[:cut], pending[cut:]
        if (at := ready.find(TORCHRUN_FAILURE)) >= 0:
            start = ready.rfind(b"\n", 0, at) + 1
            out.write(ready[:start])
            held.append(ready[start:] + pending)
            pending = b""
        else:
            out.write(ready)
        out.flush()
    out.write(pending)
    proc.stderr.close()
    return proc.wait(), b"".join(held)


def launch(cfg: PipelineConfig, name: str, config_url: str, rerun: bool = False) -> dict:
    """Runs one stage unless its output exists (`rerun`: even then); returns its manifest. Raises StageFailed or
    UserError."""
    stage = STAGE_BY_NAME[name]
    if name == "label":  # every launcher comes here (the CLI, the DAGs' tasks, the KFP components)
        check_label_pod(cfg)
    # Requires the upstream manifests (a clear error when one is missing), except a streamed one not committed yet:
    # then there is no cache key and no hit, and the stage follows that upstream's shards as they land.
    ctx = common.start_context(cfg, name)
    if not rerun and (hit := cache_hit(ctx)) is not None:  # checked before the lock too: a hit needs no lock
        return hit
    if name in ("label", "evaluate"):
        from rlaif.judges import check_services

        check_services(cfg, name)
    if ctx.wait_first and not rerun:
        ctx = common.wait_for_upstream(ctx)
        if (hit := cache_hit(ctx)) is not None:
            return hit
    if ctx.streamed:
        print(f"[{name}] streaming: reads {', '.join(ctx.streamed)}'s output as it is written", flush=True)
    with StageLock(ctx.url, f"stage '{name}' of run '{cfg.run_id}'"):
        if not rerun and (hit := cache_hit(ctx, report=False)) is not None:  # another launcher finished it meanwhile
            return hit
        run_locked(cfg, stage, config_url, ctx.config_hash, rerun)
    return manifest.require(ctx.url, name)


def cache_hit(ctx, report: bool = True) -> dict | None:
    """The stage's manifest where its output exists for this key (said so on stdout), else None."""
    hit = common.cached(ctx, report)
    if hit is not None:
        print(f"[{ctx.stage.name}] cache hit: output exists for this config and inputs, skipped", flush=True)
    return hit


def reported_errors(error_file: Path) -> list[str]:
    """The user errors a launched stage's processes wrote to their RLAIF_ERROR_FILE, each once, in order (none where
    no process wrote one)."""
    lines = error_file.read_text(encoding="utf-8").splitlines() if error_file.exists() else []
    return list(dict.fromkeys(line.strip() for line in lines if line.strip()))


def run_locked(cfg: PipelineConfig, stage: Stage, config_url: str, config_hash: str, rerun: bool = False) -> None:
    """Runs the stage in its own process(es); `rerun`: from the start, not from a checkpoint of this config."""
    name = stage.name
    nodes = getattr(getattr(cfg, name), "nodes", 1)
    start = time.time()
    if nodes > 1:
        jobs.run_multinode(stage, cfg, config_url, nodes, config_hash)
    else:
        nproc = processes_per_node(stage, cfg)
        cmd = command(stage, config_url, nproc)
        # The stage's process skips the cache check that this one just made for the same key (under the lock).
        env = dict(os.environ, PYTHONUNBUFFERED="1", RLAIF_CACHE_CHECKED=config_hash,
                   **{LAUNCHER_PID: str(os.getpid()), common.LAUNCHED_CONFIG: common.launched_config(cfg)},
                   **({common.FRESH_START: "1"} if rerun else {}))
        if stage.resources.torchrun and "OMP_NUM_THREADS" not in env:  # ranks share this machine's cores
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        print(f"[{name}] running: {shlex.join(cmd[1:])}", flush=True)  # quoted: pastes into a shell as is
        # The processes' TMPDIR is a scratch this launcher removes after them: a rank killed by a signal leaves no
        # stage scratch, and torchrun no per-run log directory, in the machine's temp directory.
        with scratch.for_processes(name, env) as env:
            errors = Path(env["TMPDIR"]) / "user-errors"
            code, agent_report = run_relaying_stderr(cmd, dict(env, RLAIF_ERROR_FILE=str(errors)))
            user_errors = reported_errors(errors)
        if code != 0 and user_errors:  # torchrun reports any rank's failure as exit code 1: keep the user error
            raise UserError(user_errors[0])
        # torchrun exits with 1 however a rank ended: its report says which rank, and how, and the line says it
        # (the rank's own output, a traceback included, is above); a report it cannot read is shown as it is.
        cause = root_cause(agent_report)
        if cause is None:
            sys.stderr.buffer.write(agent_report)
        if code != 0:
            raise StageFailed(name, code, f"stage '{name}' rank {cause[0]} {ending(cause[1])}" if cause else None)
    print(f"[{name}] done in {time.time() - start:.1f}s", flush=True)

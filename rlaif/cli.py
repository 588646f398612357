"""`rlaif run | launch | stage | graph | report | compile | submit | serve`. User errors end in one line on stderr and
exit code 2."""
from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
from pathlib import Path

from rlaif import __version__
from rlaif.config import safe_run_id
from rlaif.errors import StageFailed, Terminated, UserError, redact
from rlaif.graph import STAGE_BY_NAME


def _count(least: int, most: int | None = None):
    """An argparse type: a whole number in [least, most] (argparse then prints usage and exits 2 on anything else)."""
    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if number < least:
            raise argparse.ArgumentTypeError(f"{number} is below {least}")
        if most is not None and number > most:
            raise argparse.ArgumentTypeError(f"{number} is above {most}")
        return number
    return parse


def _serve_parser(sub, config_args) -> None:
    serve = sub.add_parser("serve", help="serve the policy or the judge as an OpenAI-compatible completions service "
                                         "(Ray Serve; replicas and autoscaling from the config's serve section)")
    config_args(serve)
    serve.add_argument("--address", help="join this Ray cluster (e.g. auto) instead of starting Ray here")
    serve.add_argument("--no-ray", action="store_true",
                       help="one replica in this process, without Ray (each pod of the plain Kubernetes Deployment)")
    serve.add_argument("--manifest", choices=["rayservice", "deployment"],
                       help="print the Kubernetes manifests of this service (KubeRay RayService, or Deployment + "
                            "Service + HPA) instead of serving")
    serve.add_argument("--cluster", help="cluster settings YAML for --manifest (images, selectors, secrets)")



def _launch_parser(sub, config_args) -> None:
    launch = sub.add_parser("launch",
                            help="run one stage as an orchestrator does: cache check, torchrun, multi-node job")
    launch.add_argument("name", choices=list(STAGE_BY_NAME))
    config_args(launch)
    launch.add_argument("--set-json", default="[]", metavar="JSON",
                        help='overrides as a JSON list, e.g. \'["ppo.lr=1e-5"]\' (what the DAGs pass)')
    launch.add_argument("--run-id", default="", help="run id; empty: --default-run-id, else the config's")
    launch.add_argument("--default-run-id", default="", metavar="NAME",
                        help="an orchestrator's run name (e.g. Airflow's dag_run.run_id), made a safe directory name: "
                             "the run id where --run-id is empty")
    launch.add_argument("--storage-root", default="", help="storage root; empty: the config's")
    launch.add_argument("--pipeline", action="store_true", help="a step of a whole run (the DAGs pass it): both "
                        "prompt splits must hold prompts")
    launch.add_argument("--rerun", action="store_true",
                        help="run the stage from its start even where its output or a checkpoint exists for this "
                        "config")
    launch.add_argument("--manifest-out", metavar="FILE",
                        help="when done, write the stage's manifest URL, digest and run id to this local JSON file "
                             "(what an Airflow task publishes as its asset event)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlaif",
                                description="RLAIF pipeline: generate -> label -> train_rm -> ppo -> evaluate")
    p.add_argument("--version", action="version", version=f"rlaif {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("config", help="list every config setting with its type, default and meaning")

    def config_args(sp):
        sp.add_argument("--config",
                        help="YAML config file (local path or s3:// URL); defaults apply where it is silent")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set ppo.lr=1e-5 (repeatable)")

    run = sub.add_parser("run", help="run the whole pipeline locally (resumes and caches by manifest)")
    config_args(run)
    run.add_argument("--run-id", help="shorthand for --set run_id=...")
    run.add_argument("--storage-root", help="shorthand for --set storage.root=...")
    run.add_argument("--rerun", action="append", default=[], choices=list(STAGE_BY_NAME), metavar="STAGE",
                     help="run this stage from its start even where its output or a checkpoint exists for this config "
                          "(repeatable), e.g. after a file of it was damaged; later stages rerun only if its output "
                          "changes")

    _launch_parser(sub, config_args)

    stage = sub.add_parser("stage", help="run one stage in this process (what launch starts, under torchrun if needed)")
    stage.add_argument("name", choices=list(STAGE_BY_NAME))
    config_args(stage)
    stage.add_argument("--shard-index", type=_count(0), default=0,
                       help="generate: this pod's part of the prompts (0-based)")
    stage.add_argument("--num-shards", type=_count(1, 10_000), default=1,
                       help="generate: parts the prompts are split into across pods; the last part to finish commits")

    comp = sub.add_parser("compile", help="write the Kubeflow pipeline YAML (and the per-stage component YAMLs)")
    comp.add_argument("target", choices=["kfp"])
    comp.add_argument("-o", "--output", required=True, help="pipeline YAML to write")
    comp.add_argument("--cluster", help="cluster settings YAML (images, GPUs, secrets); see configs/cluster.yaml")
    comp.add_argument("--components-dir", help="also write <dir>/<stage>/component.yaml")
    comp.add_argument("--config", help="size the pods for this config: label gets no GPU when its judge runs no model")

    submit = sub.add_parser("submit", help="submit a run to a Kubeflow Pipelines endpoint")
    submit.add_argument("target", choices=["kfp"])
    submit.add_argument("--endpoint", required=True, help="KFP API endpoint, e.g. https://kfp.example.com/pipeline")
    config_args(submit)
    submit.add_argument("--run-id", default="", help="run id; empty: the KFP run's name")
    submit.add_argument("--storage-root", default="", help="storage root, e.g. s3://bucket/rlaif; empty: the config's")
    submit.add_argument("--cluster", help="cluster settings YAML")
    submit.add_argument("--experiment", default="rlaif", help="KFP experiment name")

    _serve_parser(sub, config_args)
    sub.add_parser("graph", help="print the stage graph")

    rep = sub.add_parser("report", help="rebuild one run's report, or compare several runs side by side")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (local path, file:// or s3:// URL)")
    rep.add_argument("--output", help="comparison HTML file to write (several runs); the table is printed too")
    return p


def _report(runs: list[str], output: str | None) -> int:
    from rlaif import report
    from rlaif.io import storage, user_files

    urls = [storage.normalize(r) for r in runs]
    is_dir = output and storage.is_local(output) and storage.local_path(output).is_dir()
    if output and (not output.endswith((".html", ".htm")) or is_dir):
        raise UserError(f"--output {output}: name the comparison HTML file to write, e.g. compare.html")
    if output and len(urls) == 1:
        raise UserError("--output names the comparison of several runs: give two or more runs, or leave it out (a "
                        "run's own report is written into the run, at evaluate/report.html)")
    if output and storage.is_local(output):
        user_files.check_output_file(output, "--output", "compare.html")
    if len(urls) == 1:
        print(f"report: {report.write(urls[0])}")
        return 0
    markdown, page = report.compare(urls)
    print(markdown)
    if output:
        storage.write_bytes_atomic(storage.normalize(output), page.encode())
        print(f"comparison: {storage.normalize(output)}")
    return 0


def _graph(args) -> int:
    from rlaif.graph import render

    print(render())
    return 0


def _config(args) -> int:
    from rlaif.config import config_fields

    for key, kind, default, doc in config_fields():
        print(f"{key} ({kind}, default {default!r}): {doc}")
    return 0


def _compile(args) -> int:
    from rlaif.orchestration import kfp_pipeline

    path = kfp_pipeline.compile_pipeline(args.output, args.cluster, args.components_dir, args.config)
    print(f"pipeline: {path}")
    return 0


def _serve(args) -> int:
    from rlaif.config import load_config
    from rlaif.serving.engine import check_bindable, check_served_model

    cfg = load_config(args.config, args.overrides)
    if args.cluster and not args.manifest:
        raise UserError("--cluster is read by --manifest only: add --manifest rayservice|deployment, or drop it")
    if args.address and (args.no_ray or args.manifest):
        raise UserError("--address is for serving on Ray here: --no-ray and --manifest do not use it, drop it")
    if args.no_ray and args.manifest:
        raise UserError("--manifest renders the service's Kubernetes manifests (--manifest deployment: pods without "
                        "Ray): drop --no-ray")
    check_served_model(cfg, cfg.serve.model)
    if args.manifest:
        from rlaif.orchestration.cluster import load
        from rlaif.serving.manifests import render

        print(render(cfg, load(args.cluster), args.manifest), end="")
        return 0
    if args.no_ray:
        import uvicorn

        from rlaif.serving.api import plain_app
        from rlaif.serving.engine import make_engine

        check_bindable(cfg.serve.host, cfg.serve.port)
        app = plain_app(make_engine(cfg, cfg.serve.model), cfg.serve.service_name, cfg.serve.route_prefix)
        print(f"serving the {cfg.serve.model} at {cfg.serve.base_url} (one replica, no Ray)", flush=True)
        uvicorn.run(app, host=cfg.serve.host, port=cfg.serve.port, log_level="warning")
        return 0
    try:
        from rlaif.serving import ray_app
    except ImportError:
        raise UserError("rlaif serve needs Ray Serve: pip install 'rlaif[serve]' (or use --no-ray)") from None
    ray_app.run(cfg, args.address)
    return 0


def _submit(args) -> int:
    from rlaif.orchestration import kfp_pipeline

    run = kfp_pipeline.submit(args.endpoint, args.config, args.overrides, args.run_id, args.storage_root,
                              args.cluster, args.experiment)
    print(f"submitted: {run}")
    return 0


def _launch(args) -> int:
    import json

    from rlaif.orchestration import launch

    try:
        extra = json.loads(args.set_json)
    except json.JSONDecodeError:
        extra = None
    if not isinstance(extra, list) or not all(isinstance(x, str) for x in extra):
        raise UserError(f"--set-json must be a JSON list of KEY=VALUE strings, got {args.set_json!r}")
    run_id = args.run_id or (safe_run_id(args.default_run_id) if args.default_run_id else "")
    if args.manifest_out:
        from rlaif.io.user_files import check_output_file

        check_output_file(args.manifest_out, "--manifest-out", "manifest.json")
    cfg = launch.load_config_source(args.config, [*args.overrides, *extra], run_id, args.storage_root)
    config_url = launch.prepare(cfg, pipeline=args.pipeline, launched=args.name)
    done = launch.launch(cfg, args.name, config_url, rerun=args.rerun)
    if args.manifest_out:
        from rlaif.io import manifest, storage
        from rlaif.stages.common import stage_url

        out = {"stage": args.name, "run_id": cfg.run_id, "digest": done["digest"],
               "url": storage.join(stage_url(cfg, args.name), manifest.MANIFEST)}
        storage.local_path(storage.normalize(args.manifest_out)).write_text(json.dumps(out) + "\n", encoding="utf-8")
    return 0


def _run(args) -> int:
    from rlaif.orchestration.launch import load_config_source
    from rlaif.runner import run

    for flag, value in (("--run-id", args.run_id), ("--storage-root", args.storage_root)):
        if value is not None and not value.strip():  # an unset shell variable: the config's value would be used
            raise UserError(f"{flag} is empty: give a value, or leave the flag out to use the config's")
    run(load_config_source(args.config, args.overrides, args.run_id or "", args.storage_root or ""), set(args.rerun))
    return 0


def _stage(args) -> int:
    from rlaif.config import load_config
    from rlaif.runner import run_stage, stage_scratch

    with stage_scratch(args.name):
        run_stage(load_config(args.config, args.overrides), args.name, args.shard_index, args.num_shards)
    return 0


COMMANDS = {"graph": _graph, "config": _config, "compile": _compile, "submit": _submit, "launch": _launch,
            "report": lambda args: _report(args.runs, args.output), "run": _run, "stage": _stage,
            "serve": _serve}


def _terminate(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        return _dispatch(args)
    except Terminated:
        _stopped("terminated")
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _stopped(how: str) -> None:
    """Says once that a run was stopped: in the process the user started. A launcher's child (a stage, its ranks, a
    streaming group's launchers: they have the launcher's error file) stops quietly, as its launcher says it."""
    if not os.environ.get("RLAIF_ERROR_FILE"):
        print(how, file=sys.stderr)


def check_run_id(args) -> None:
    """Every command's --run-id, checked here by the config's own rule (run_id names a directory under the storage
    root) and refused, never rewritten: a rewritten id (`../escape` -> `escape`) is a directory the user did not name.
    Empty means the command's default (the config's, the KFP run's name)."""
    from rlaif.config import PipelineConfig

    value = getattr(args, "run_id", None)
    if not value:
        return
    try:
        PipelineConfig._run_id(value)  # the run_id field's validator: one rule for flags, configs and --set
    except ValueError as exc:
        raise UserError(f"--run-id {value!r}: {exc}") from None


def _dispatch(args) -> int:
    try:
        check_run_id(args)
        if args.command not in ("graph", "config"):
            from rlaif.io import storage

            storage.configure(None)  # a config or run given as an s3:// URL needs the endpoint from the environment
        return COMMANDS[args.command](args)
    except UserError as exc:
        return _user_error(str(exc))
    except KeyboardInterrupt:
        _stopped("interrupted")
        return 130
    except BrokenPipeError:  # `rlaif config | head`: the reader left; a command that prints ends quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if args.command in PRINTS_ONLY:
            return 0
        return _user_error(f"`rlaif {args.command}` stopped: a pipe it wrote to was closed (the program reading its "
                           "output exited?): run it without the pipe, or send its output to a file")
    except StageFailed as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2 if exc.code == 2 else 1
    except Exception as exc:
        from rlaif.io import storage

        if _a_peer_rank_reported_first():
            return 1
        if (problem := disk_problem(exc) or storage.failure_message(exc)) is None:
            raise
        return _user_error(problem)


def _a_peer_rank_reported_first() -> bool:
    """A rank of a multi-process stage that failed after a peer stopped with a user error: its own failure (a
    collective that lost that peer: gloo's "Connection closed by peer") is the echo, and its traceback would bury
    the peer's line, which the launcher prints. The peer writes its line before it exits, so before this rank's
    collective can see the peer gone."""
    error_file = os.environ.get("RLAIF_ERROR_FILE")
    if not error_file or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    try:
        return os.path.getsize(error_file) > 0
    except OSError:
        return False


def _user_error(message: str) -> int:
    """One line on stderr (a stage under launch: in its error file, which launch prints once), exit code 2."""
    if error_file := os.environ.get("RLAIF_ERROR_FILE"):
        try:
            with open(error_file, "a", encoding="utf-8") as f:
                f.write(f"{redact(message)}\n")
            return 2
        except OSError:  # not a launcher's file (a variable left set): the message goes where a user sees it
            pass
    try:
        print(f"error: {redact(message)}", file=sys.stderr)
    except BrokenPipeError:  # stderr went to the same closed pipe (`2>&1 | head`)
        pass
    return 2


PRINTS_ONLY = ("graph", "config")  # commands whose output is all they do: a reader may stop early
DISK_FULL = ("No space left on device", "Disk quota exceeded", "StorageFull")
READ_ONLY = ("Read-only file system", "ReadOnlyFilesystem")
ELSEWHERE = "storage.root, TMPDIR or RLAIF_CACHE"


WRONG_KIND = {errno.ENOTDIR: "part of this path is a file where a directory is expected",
              errno.EISDIR: "this is a directory where a file is expected",
              errno.EEXIST: "this exists and is not the directory expected here"}


def _wrong_kind_on_disk(error: OSError) -> str | None:
    """The error's path (a rename's destination first) where it is what its errno says: not a race, such as two
    ranks creating one directory."""
    for name in (error.filename2, error.filename):
        if not isinstance(name, str):
            continue
        path = Path(name)
        if ((error.errno == errno.ENOTDIR and any(part.is_file() for part in (path, *path.parents)))
                or (error.errno == errno.EISDIR and path.is_dir())
                or (error.errno == errno.EEXIST and path.exists() and not path.is_dir())):
            return name
    return None


def disk_problem(exc: BaseException) -> str | None:
    """A full or read-only disk, or a path of the wrong kind (a file where the storage tree or cache holds a
    directory, or the reverse), behind an exception (an OSError, or a library's error wrapping one: safetensors,
    torch.save), as a one-line user error; None for anything else."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in WRONG_KIND and (where := _wrong_kind_on_disk(seen)):
            return (f"{where}: {WRONG_KIND[seen.errno]}: move it away, or point storage.root, --run-id or "
                    "RLAIF_CACHE elsewhere")
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            where = seen.filename2 or seen.filename
            fix = ("point it at a writable disk" if seen.errno == errno.EROFS
                   else f"free space there, or point {ELSEWHERE} at a disk with room")
            return f"cannot write{f' {where}' if where else ''}: {seen.strerror}: {fix}"
        text = str(seen).splitlines()[0][:200] if str(seen) else ""
        if any(marker in text for marker in DISK_FULL):
            return f"a write failed for lack of disk space ({text}): free space, or point {ELSEWHERE} elsewhere"
        if any(marker in text for marker in READ_ONLY):
            return f"a write failed on a read-only disk ({text}): point {ELSEWHERE} at a writable disk"
        seen = seen.__cause__ or seen.__context__
    return None

"""`rlaif run | launch | stage | graph | report | compile | submit | serve`. User errors end in one line on stderr and
exit code 2."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import sys
import threading
from typing import NoReturn

from rlaif import cli_args
from rlaif.errors import StageFailed, Terminated, UserError, redact
from rlaif.stopping import ignore_while_exiting, stop_signals, stopped


def _report(runs: list[str], output: str | None) -> int:
    from rlaif import report
    from rlaif.io import output_files, storage

    urls = [storage.normalize(r) for r in runs]
    if any(url.startswith("s3://") for url in urls):
        storage.configure(None)  # AWS_ENDPOINT_URL's endpoint, and S3 calls bounded as in the stages
    if len(set(urls)) < len(urls):
        twice = next(url for url in urls if urls.count(url) > 1)
        raise UserError(f"run {twice} is given twice: name each run to compare once")
    if output and len(urls) == 1:
        raise UserError("--output names the comparison of several runs: give two or more runs, or leave it out (a "
                        "run's own report is written into the run, at evaluate/report.html)")
    target = output and output_files.check_output_file(output, "--output", "the comparison HTML file",
                                                       "compare.html", (".html", ".htm"), remote=True)
    if target and (inside := next((url for url in urls if target.startswith(url.rstrip("/") + "/")), None)):
        raise UserError(f"--output {output} is inside run {inside}, whose files are its own (its report is rebuilt "
                        "there): write the comparison outside the runs")
    if len(urls) == 1:
        print(f"report: {storage.browsable(report.write(urls[0]))}")
        return 0
    markdown, page = report.compare(urls)
    said = sys.stderr if target and output_files.is_stream(target) else sys.stdout  # the page alone on a stream
    if target:  # written before anything is printed: a reader of the table that stops early (| head) loses nothing
        output_files.write_output_file(target, page.encode(), "--output")
    print(markdown, file=said)
    if target:
        print(f"comparison: {target}", file=said)
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
    from rlaif.io import storage
    from rlaif.io.output_files import is_stream
    from rlaif.orchestration import kfp_pipeline

    for flag, given in (("--config", args.config), ("--cluster", args.cluster)):  # it would be replaced unread
        if given and "\n" not in given and not is_stream(args.output) \
                and storage.normalize(given) == storage.normalize(args.output):
            raise UserError(f"-o {args.output} is the {flag} file this reads: write the pipeline to another file")
    path = kfp_pipeline.compile_pipeline(args.output, args.cluster, args.components_dir, args.config)
    print(f"pipeline: {path}", file=sys.stderr if is_stream(path) else sys.stdout)  # the YAML alone on a stream
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
        serve_until_stopped(uvicorn.Config(app, host=cfg.serve.host, port=cfg.serve.port, log_level="warning"))
        return 0
    try:
        from rlaif.serving import ray_app
    except ImportError:
        raise UserError("rlaif serve needs Ray Serve: pip install 'rlaif[serve]' (or use --no-ray)") from None
    ray_app.run(cfg, args.address)
    return 0


def serve_until_stopped(config) -> None:
    """uvicorn's server, stopped as rlaif.stopping stops a command: the first SIGINT or SIGTERM ends it gracefully
    (requests in flight answered), a second is noted. uvicorn's own handlers force an exit on the second, which failed
    the requests in flight with HTTP 500, and re-raised the signals into ours inside its event loop (tracebacks)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with stop_signals(on_first=lambda signum: setattr(self, "should_exit", True)):
                yield

    Server(config).run()


def _submit(args) -> int:
    from rlaif.orchestration import kfp_pipeline

    run = kfp_pipeline.submit(args.endpoint, args.config, args.overrides, args.run_id, args.storage_root,
                              args.cluster, args.experiment)
    print(f"submitted: {run}")
    return 0


def _launch(args) -> int:
    from rlaif.io import manifest, output_files, storage
    from rlaif.orchestration import launch

    manifest_out = args.manifest_out and output_files.check_output_file(args.manifest_out, "--manifest-out",
                                                                        "the manifest JSON file", "manifest.json")
    try:
        extra = json.loads(args.set_json)
    except json.JSONDecodeError:
        extra = None
    if not isinstance(extra, list) or not all(isinstance(x, str) for x in extra):
        raise UserError(f"--set-json must be a JSON list of KEY=VALUE strings, got {args.set_json!r}")
    overrides = [*extra, *args.overrides]  # a step's own --set items after the run's: theirs win (check_flags_agree)
    run_id = launch.orchestrated_run_id(overrides, args.run_id, args.default_run_id)
    cfg = launch.load_config_source(args.config, overrides, run_id, args.storage_root)
    config_url = launch.prepare(cfg, pipeline=args.pipeline, launched=args.name)
    done = launch.launch(cfg, args.name, config_url, rerun=args.rerun)
    if manifest_out:
        from rlaif.stages.common import stage_url

        out = {"stage": args.name, "run_id": cfg.run_id, "digest": done["digest"],
               "url": storage.join(stage_url(cfg, args.name), manifest.MANIFEST)}
        output_files.write_output_file(manifest_out, (json.dumps(out) + "\n").encode(), "--manifest-out")
    return 0


def _run(args) -> int:
    from rlaif.orchestration.launch import load_config_source
    from rlaif.runner import run

    run(load_config_source(args.config, args.overrides, args.run_id or "", args.storage_root or ""), set(args.rerun))
    return 0


def _stage(args) -> int:
    from rlaif import scratch
    from rlaif.config import load_config
    from rlaif.runner import run_stage

    with scratch.in_process(args.name):
        run_stage(load_config(args.config, args.overrides), args.name, args.shard_index, args.num_shards)
    return 0


COMMANDS = {"graph": _graph, "config": _config, "compile": _compile, "submit": _submit, "launch": _launch,
            "report": lambda args: _report(args.runs, args.output), "run": _run, "stage": _stage,
            "serve": _serve}


def main(argv: list[str] | None = None) -> int:
    try:
        args = cli_args.parser().parse_args(argv)
    except UserError as exc:  # an empty path (_given)
        return _user_error(str(exc))
    with stop_signals():
        try:
            return _dispatch(args)
        except (KeyboardInterrupt, Terminated) as stop:  # caught here, where a second signal is only noted
            return stopped(stop)


def entry() -> NoReturn:
    """The `rlaif` program (its console script and `python -m rlaif`): main(), then the process ends without the
    interpreter's object-by-object teardown, which after torch and transformers are loaded takes 1.5-2 s (its last
    garbage collection, torch's operator registry) in every stage process, rank and launcher. By then a command has
    written, closed and uploaded what it writes; exit handlers (Ray's shutdown, logging's flush) still run, and
    stdout and stderr are flushed (an output that cannot be written ends in code 120, as Python's own exit does).
    An exception that escapes main() ends the process as usual, traceback and all, as does a process under a
    profiler or debugger, or one with a thread still working (whose work the usual exit waits for)."""
    code = main() or 0
    ignore_while_exiting()
    if sys.getprofile() or sys.gettrace() or any(not thread.daemon and thread.is_alive() for thread in
                                                 threading.enumerate() if thread is not threading.main_thread()):
        sys.exit(code)  # `python -m cProfile -m rlaif` reports at teardown; a pool's queued work is finished
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: started with that stream closed
                stream.flush()
        except BrokenPipeError:  # the reader left: nothing more can be said there
            pass
        except (OSError, ValueError) as exc:  # a full disk, a stream closed under us: the output is incomplete
            code = code or 120
            with contextlib.suppress(Exception):
                print(f"error: the output could not be written ({exc})", file=sys.__stderr__)
    if sys.platform != "win32":  # what native libraries printed through C's stdio (libc's fflush(NULL))
        ctypes.CDLL(None).fflush(None)
    os._exit(code)


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


def check_flags_agree(args) -> None:
    """--run-id and --storage-root beside a --set of the same setting to another value: the flag won, silently. A
    setting given twice in --set / --set-json: the last won, silently (a pipeline step's own --set items excepted)."""
    from rlaif.config.loading import parse_value, refuse_repeated_keys, split_override

    items, own = _override_items(args), getattr(args, "overrides", None) or []
    if getattr(args, "pipeline", False):  # a DAG's step: its own --set items (a streaming DAG's label.streaming=true)
        refuse_repeated_keys(own)  # win over the run's --set-json, as KFP's typed parameters win over its overrides
        refuse_repeated_keys(items[len(own):])
    else:
        refuse_repeated_keys(items)  # every item is KEY=VALUE past it
    for flag, key in (("--run-id", "run_id"), ("--storage-root", "storage.root")):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        for item in items:
            parts, given = split_override(item)
            if value and ".".join(parts) == key and str(parse_value(given)) != value:
                raise UserError(f"{flag} {value} and --set {item} name two values of {key}: give one of them")


def _override_items(args) -> list[str]:
    """--set's items, and --set-json's where it holds a list of strings (launch says what else is wrong with it)."""
    try:
        extra = json.loads(getattr(args, "set_json", None) or "[]")
    except json.JSONDecodeError:
        extra = []
    extra = extra if isinstance(extra, list) and all(isinstance(x, str) for x in extra) else []
    return [*(getattr(args, "overrides", None) or []), *extra]


def _dispatch(args) -> int:
    try:
        check_run_id(args)
        check_flags_agree(args)
        if args.command not in ("graph", "config"):
            from rlaif.io import storage

            storage.configure(None)  # a config or run given as an s3:// URL needs the endpoint from the environment
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `rlaif config | head`: the reader left; a command that prints ends quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if args.command in PRINTS_ONLY:
            return 0
        return _user_error(f"`rlaif {args.command}` stopped: a pipe it wrote to was closed (the program reading its "
                           "output exited?): run it without the pipe, or send its output to a file")
    except Exception as exc:
        if (code := report_failure(exc)) is None:
            raise
        return code


def report_failure(exc: BaseException) -> int | None:
    """A failure as a user sees it, and its exit code: a user error, a disk or object-storage problem in one line
    (code 2), a failed stage in one line after its own output (1, or 2 for a stage's user error); None for a bug,
    whose traceback stays. Also what a KFP step reports (its executor would print a traceback for each)."""
    if isinstance(exc, UserError):
        return _user_error(str(exc))
    if isinstance(exc, StageFailed):  # one line, where a runner of several launchers takes it from (no echo)
        return _user_error(str(exc), code=2 if exc.code == 2 else 1)
    from rlaif.io import storage
    from rlaif.io.disk_problems import disk_problem

    if _a_peer_rank_reported_first():
        return 1
    problem = disk_problem(exc) or storage.failure_message(exc)
    return None if problem is None else _user_error(problem)


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


def _user_error(message: str, code: int = 2) -> int:
    """One line on stderr (a stage under launch: in its error file, which launch prints once); the exit code."""
    if error_file := os.environ.get("RLAIF_ERROR_FILE"):
        try:
            with open(error_file, "a", encoding="utf-8") as f:
                f.write(f"{redact(message)}\n")
            return code
        except OSError:  # not a launcher's file (a variable left set): the message goes where a user sees it
            pass
    try:
        print(f"error: {redact(message)}", file=sys.stderr)
    except BrokenPipeError:  # stderr went to the same closed pipe (`2>&1 | head`)
        pass
    return code


# Commands that print only after all they write (or print all they do): a reader may stop early.
PRINTS_ONLY = ("graph", "config", "report")

"""`rlaif run | stage | graph`. User errors end in one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import sys

from rlaif.errors import UserError
from rlaif.graph import STAGE_BY_NAME


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlaif", description="RLAIF pipeline: generate -> label -> train_rm -> ppo -> evaluate")
    sub = p.add_subparsers(dest="command", required=True)

    def config_args(sp):
        sp.add_argument("--config", help="YAML config file (local path or s3:// URL); defaults apply where it is silent")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set ppo.lr=1e-5 (repeatable)")

    run = sub.add_parser("run", help="run the whole pipeline locally (resumes and caches by manifest)")
    config_args(run)
    run.add_argument("--run-id", help="shorthand for --set run_id=...")
    run.add_argument("--storage-root", help="shorthand for --set storage.root=...")

    stage = sub.add_parser("stage", help="run one stage (what a container runs)")
    stage.add_argument("name", choices=list(STAGE_BY_NAME))
    config_args(stage)

    sub.add_parser("graph", help="print the stage graph")

    rep = sub.add_parser("report", help="rebuild one run's report, or compare several runs side by side")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (local path, file:// or s3:// URL)")
    rep.add_argument("--output", help="comparison HTML file to write (several runs); the table is printed too")
    return p


def _report(runs: list[str], output: str | None) -> int:
    from rlaif import report
    from rlaif.io import storage

    urls = [storage.normalize(r) for r in runs]
    if len(urls) == 1:
        print(f"report: {report.write(urls[0])}")
        return 0
    markdown, page = report.compare(urls)
    print(markdown)
    if output:
        storage.write_bytes_atomic(storage.normalize(output), page.encode())
        print(f"comparison: {storage.normalize(output)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "graph":
            from rlaif.graph import render

            print(render())
            return 0
        from rlaif.config import load_config
        from rlaif.io import storage

        storage.configure(None)
        if args.command == "report":
            return _report(args.runs, args.output)  # a config given as s3:// URL needs the endpoint from the environment
        overrides = list(args.overrides)
        if args.command == "run":
            overrides += [f"run_id={args.run_id}"] * bool(args.run_id) + [f"storage.root={args.storage_root}"] * bool(args.storage_root)
        cfg = load_config(args.config, overrides)
        if args.command == "run":
            from rlaif.runner import run

            run(cfg)
        else:
            from rlaif.runner import run_stage

            run_stage(cfg, args.name)
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        from rlaif.runner import StageFailed

        if isinstance(exc, StageFailed):
            print(f"error: {exc}", file=sys.stderr)
            return 2 if exc.code == 2 else 1
        raise

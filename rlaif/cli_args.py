"""The command line's arguments: every subcommand, its options and their argparse types (cli.py runs them)."""
from __future__ import annotations

import argparse

from rlaif import __version__
from rlaif.errors import UserError
from rlaif.graph import STAGE_BY_NAME

# What to do about an empty value of a path or URL option (_given), by flag.
EMPTY_FIX = {"--config": "name a YAML config file, or leave --config out to run the defaults",
             "--cluster": "name a cluster settings YAML, or leave --cluster out for the default settings",
             "--run-id": "give a value, or leave the flag out to use the config's",
             "--storage-root": "give a value, or leave the flag out to use the config's",
             "--manifest-out": "name the JSON file to write, or leave --manifest-out out",
             "--components-dir": "name a directory, or leave --components-dir out",
             "RUN_DIR": "name a run directory (local path, file:// or s3:// URL)"}


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


def _given(flag: str, fix: str = ""):
    """An argparse type for a path or URL value: an empty or blank one (most often an unset shell variable) is
    refused, never taken as the flag left out, which would quietly run on defaults. It raises a UserError, not
    argparse's error, so that main prints one line, as for every user error."""
    def parse(text: str) -> str:
        if not text.strip():
            raise UserError(f"{flag} is empty: {fix or EMPTY_FIX[flag]}")
        return text
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
    serve.add_argument("--cluster", type=_given("--cluster"),
                       help="cluster settings YAML for --manifest (images, selectors, secrets)")


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
                        "prompt splits must hold prompts, and the step's own --set items win over the run's "
                        "--set-json")
    launch.add_argument("--rerun", action="store_true",
                        help="run the stage from its start even where its output or a checkpoint exists for this "
                        "config")
    launch.add_argument("--manifest-out", metavar="FILE", type=_given("--manifest-out"),
                        help="when done, write the stage's manifest URL, digest and run id to this local JSON file "
                             "(what an Airflow task publishes as its asset event)")


def _kfp_parsers(sub, config_args) -> None:
    comp = sub.add_parser("compile", help="write the Kubeflow pipeline YAML (and the per-stage component YAMLs)")
    comp.add_argument("target", choices=["kfp"])
    comp.add_argument("-o", "--output", required=True, help="pipeline YAML to write (- for standard output)",
                      type=_given("--output", "name the pipeline YAML file to write, e.g. rlaif_pipeline.yaml"))
    comp.add_argument("--cluster", type=_given("--cluster"),
                      help="cluster settings YAML (images, GPUs, secrets); see configs/cluster.yaml")
    comp.add_argument("--components-dir", type=_given("--components-dir"),
                      help="also write <dir>/<stage>/component.yaml")
    comp.add_argument("--config", type=_given("--config"),
                      help="size the pods for this config: label gets no GPU when its judge runs no model")

    submit = sub.add_parser("submit", help="submit a run to a Kubeflow Pipelines endpoint")
    submit.add_argument("target", choices=["kfp"])
    submit.add_argument("--endpoint", required=True, help="KFP API endpoint, e.g. https://kfp.example.com/pipeline")
    config_args(submit)
    submit.add_argument("--run-id", default="", help="run id; empty: the KFP run's name")
    submit.add_argument("--storage-root", default="", help="storage root, e.g. s3://bucket/rlaif; empty: the config's")
    submit.add_argument("--cluster", type=_given("--cluster"), help="cluster settings YAML")
    submit.add_argument("--experiment", default="rlaif", help="KFP experiment name")


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line, as every other user error is (argparse prints the usage block
    first); the subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="rlaif",
                                description="RLAIF pipeline: generate -> label -> train_rm -> ppo -> evaluate")
    p.add_argument("--version", action="version", version=f"rlaif {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("config", help="list every config setting with its type, default and meaning")

    def config_args(sp):
        sp.add_argument("--config", type=_given("--config"),
                        help="YAML config file (local path or s3:// URL); defaults apply where it is silent")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set ppo.lr=1e-5 (repeatable)")

    run = sub.add_parser("run", help="run the whole pipeline locally (resumes and caches by manifest)")
    config_args(run)
    run.add_argument("--run-id", type=_given("--run-id"), help="shorthand for --set run_id=...")
    run.add_argument("--storage-root", type=_given("--storage-root"), help="shorthand for --set storage.root=...")
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

    _kfp_parsers(sub, config_args)
    _serve_parser(sub, config_args)
    sub.add_parser("graph", help="print the stage graph")

    rep = sub.add_parser("report", help="rebuild one run's report, or compare several runs side by side")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", type=_given("RUN_DIR"),
                     help="run directories (local path, file:// or s3:// URL)")
    rep.add_argument("--output", type=_given("--output", "name the comparison HTML file to write, or leave it out"),
                     help="comparison HTML file to write (several runs); the table is printed too")
    return p

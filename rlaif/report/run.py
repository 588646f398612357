"""Everything a report reads from a run directory, loaded once. Only evaluate/metrics.json is required; every other
file (stage manifests, config.yaml, label/metrics.json, ppo/metrics.jsonl, evaluate/examples.jsonl) may be missing or
come from an older version of rlaif, and the report shows "n/a" where it does."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from rlaif.errors import UserError
from rlaif.graph import topological_order
from rlaif.io import manifest, storage, user_files

NA = "n/a"


def num(value, spec: str = ".3f", suffix: str = "") -> str:
    """A number formatted with `spec`, or "n/a" for anything that is not one (None, a missing field, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NA
    return f"{value:{spec}}{suffix}"


def dig(obj, *keys):
    """obj[k1][k2]... or None where a level is missing or not a mapping."""
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def text(value) -> str:
    return NA if value is None or value == "" else str(value)


def duration(seconds) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return NA
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


@dataclass
class Run:
    url: str
    metrics: dict  # evaluate/metrics.json
    examples: list[dict]  # evaluate/examples.jsonl
    ppo_rows: list[dict]  # ppo/metrics.jsonl
    manifests: dict[str, dict | None]  # stage -> its manifest, None where absent or unreadable
    label_metrics: dict  # label/metrics.json, else the label manifest's summary, else {}
    config: dict  # config.yaml as plain data ({} when absent): what the run was launched with
    config_digest: str | None  # sha256 of config.yaml

    @property
    def run_id(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def summary(self, stage: str) -> dict:
        return dig(self.manifests.get(stage), "summary") or {}


def read_json(url: str, lines: bool = False, recorded: dict | None = None):
    """A run file the report is built from; a corrupt one is a one-line error, not a traceback. `recorded`: the
    stage manifest's sha256 of each of its files, which this one must match (a file edited or replaced since the
    stage committed it would be reported as the run's own result)."""
    data = storage.read_bytes(url)
    name = url.rsplit("/", 1)[-1]
    if recorded and recorded.get(name) and hashlib.sha256(data).hexdigest() != recorded[name]:
        raise UserError(f"{url} does not match its manifest checksum (changed since the stage wrote it): "
                        f"{storage.rerun_hint(url)}")
    try:
        body = data.decode("utf-8")
        return [json.loads(line) for line in user_files.text_lines(body) if line.strip()] if lines else json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{url} is corrupt (not UTF-8 JSON): {storage.rerun_hint(url)}") from None


def read_jsonl(url: str, recorded: dict | None = None) -> list[dict]:
    return read_json(url, lines=True, recorded=recorded) if storage.exists(url) else []


def read_metrics(run_url: str, recorded: dict | None = None) -> dict:
    metrics_url = storage.join(run_url, "evaluate", "metrics.json")
    if not storage.exists(metrics_url):
        raise UserError(f"{metrics_url} not found: is {run_url} a run directory whose evaluate stage has run?")
    metrics = read_json(metrics_url, recorded=recorded)
    if not isinstance(metrics, dict) or not isinstance(metrics.get("judges"), dict):
        raise UserError(f"{metrics_url} is not an evaluation's metrics: {storage.rerun_hint(metrics_url)}")
    return metrics


def _manifest(stage_url: str) -> dict | None:
    """A stage's manifest for the report: an absent, corrupt or older-schema one reads as absent (n/a)."""
    try:
        return manifest.read(stage_url)
    except UserError:
        return None


def _optional_json(url: str) -> dict:
    try:
        found = read_json(url) if storage.exists(url) else {}
    except UserError:
        return {}
    return found if isinstance(found, dict) else {}


def _config(run_url: str) -> tuple[dict, str | None]:
    """config.yaml as plain data (not validated: an older run's config may name settings that are gone)."""
    import yaml

    url = storage.join(run_url, "config.yaml")
    if not storage.exists(url):
        return {}, None
    data = storage.read_bytes(url)
    try:
        parsed = yaml.safe_load(data)
    except yaml.YAMLError:
        parsed = None
    return (parsed if isinstance(parsed, dict) else {}), hashlib.sha256(data).hexdigest()


def load_run(run_url: str, verify: bool = True) -> Run:
    """The run's files for its report. `verify`: evaluate's files must be the ones its manifest recorded (not while
    the evaluate stage itself builds the report, before its manifest is written)."""
    # One line for a run that cannot be read: no credentials, an unreachable endpoint, a file where a directory was.
    with user_files.user_read_errors(run_url, "run", "check the run's path (its evaluate/metrics.json and manifests "
                                  "are files), and for s3:// the endpoint and credentials"):
        manifests = {stage.name: _manifest(storage.join(run_url, stage.name)) for stage in topological_order()}
        recorded = _recorded(manifests["evaluate"]) if verify else None
        metrics = read_metrics(run_url, recorded)
        label = (_optional_json(storage.join(run_url, "label", "metrics.json")) or dig(manifests["label"], "summary")
                 or {})
        config, config_digest = _config(run_url)
        return Run(run_url, metrics, read_jsonl(storage.join(run_url, "evaluate", "examples.jsonl"), recorded),
                   read_jsonl(storage.join(run_url, "ppo", "metrics.jsonl")), manifests, label, config, config_digest)


def _recorded(stage_manifest: dict | None) -> dict:
    """The sha256 a stage's manifest recorded for each of its files, by name."""
    return {entry.get("path"): entry.get("sha256") for entry in dig(stage_manifest, "files") or []
            if isinstance(entry, dict)}


def evaluated_metrics(run_url: str) -> tuple[dict, bool]:
    """A run's evaluate/metrics.json, checked against evaluate's manifest where it has one (for comparisons), and
    whether it has one (without, the metrics are an earlier or unfinished evaluation's, or one whose quality gates
    failed: not committed, and not checked)."""
    with user_files.user_read_errors(run_url, "run", "check the run's path, and for s3:// the endpoint and "
                                                     "credentials"):
        evaluated = _manifest(storage.join(run_url, "evaluate"))
        return read_metrics(run_url, _recorded(evaluated)), evaluated is not None


def stale_notes(run: Run) -> list[str]:
    """Where the results shown are not the run's current state: evaluate's manifest gone (a re-run that did not
    finish), or an upstream output it was evaluated on since removed or made again; the settings shown are the
    run's config.yaml now."""
    evaluated = run.manifests.get("evaluate")
    if evaluated is None:
        return ["These results are from an earlier evaluation of this run: evaluate has no manifest (a re-run that "
                "did not finish?), so they may not match the settings shown. Re-run the pipeline to update them."]
    notes = []
    for dep, recorded in (evaluated.get("inputs") or {}).items():
        current = run.manifests.get(dep, False)
        if current is False or current is not None and current.get("digest") == recorded:
            continue  # not a stage (a file's digest), or the output evaluate read
        now = "removed (a re-run that did not finish?)" if current is None else "made again"
        notes.append(f"These results evaluated an earlier {dep} output of this run, since {now}: they may not match "
                     f"the settings or curves shown. Re-run the pipeline to update them.")
    return notes

"""Everything a report reads from a run directory, loaded once. Only evaluate/metrics.json is required; every other
file (stage manifests, config.yaml, label/metrics.json, ppo/metrics.jsonl, evaluate/examples.jsonl) may be missing or
come from an older version of rlaif, and the report shows "n/a" where it does."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from rlaif import __version__
from rlaif.errors import UserError, one_line
from rlaif.graph import topological_order
from rlaif.io import manifest, output_files, storage, user_files
from rlaif.report.lineage import Lineage, trace

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
    problems: dict[str, tuple[str, str]]  # stage -> why its manifest, which is there, cannot be read, and the fix
    lineage: Lineage  # which outputs and settings now are not the ones the results were made from
    malformed: list[str]  # metrics.json fields of another shape than the report reads, shown as n/a

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


# The shape of each metrics.json field the report reads: a number (not a bool), a class, an interval (two numbers), a
# list of one class, or a mapping of fields ("*": any key). Fields the report does not read are kept as they are.
NUMBER, INTERVAL = "number", "interval"
JUDGE_SHAPE = {"judge": str, "win_rate": NUMBER, "win_rate_ci95": INTERVAL, "win_rate_length_controlled": NUMBER,
               "wins": int, "ties": int, "losses": int, "position_consistency": NUMBER}
DIVERSITY_SHAPE = {"top_response_share": NUMBER, "top_response": str, "distinct_2": NUMBER}
METRICS_SHAPE = {
    **dict.fromkeys(("win_rate", "win_rate_length_controlled", "reward_policy_mean", "reward_reference_mean",
                     "kl_to_reference", "kl_to_reference_per_token", "length_policy_mean", "length_reference_mean",
                     "eos_rate_policy", "eos_rate_reference"), NUMBER),
    "n_prompts": int, "judges": {"*": JUDGE_SHAPE},
    "diversity": DIVERSITY_SHAPE, "diversity_reference": DIVERSITY_SHAPE,
    "upstream": dict.fromkeys(("label_reference_agreement", "rm_held_out_accuracy", "rm_held_out_reference_accuracy"),
                              NUMBER),
    "gates": {"checked": bool, "passed": bool, "failures": [str]}}


def _running(run_url: str) -> str | None:
    """What of the run a launcher holds now, else None."""
    from rlaif.graph import STAGE_BY_NAME
    from rlaif.io.lock import live_holders

    return next((what for what, _ in live_holders(run_url, STAGE_BY_NAME)), None)


def read_metrics(run_url: str, recorded: dict | None = None) -> tuple[dict, list[str]]:
    """evaluate/metrics.json, and the dotted names of its fields of another shape than the report reads. One rule
    for every field: one of another shape (an older rlaif's, or edited by hand; without an evaluate manifest nothing
    checks it) reads as absent, a mapping as empty, so the report shows "n/a" there, as it does for a field an older
    run lacks, and says which; only a file that is no evaluation's metrics at all is refused."""
    metrics_url = storage.join(run_url, "evaluate", "metrics.json")
    if not storage.exists(metrics_url):
        if storage.bucket_missing(run_url):
            bucket = run_url.split("/")[2]
            raise UserError(f"{run_url}: bucket {bucket!r} does not exist at this endpoint"
                            f"{output_files.bucket_hints(bucket)}: check the URL, and AWS_ENDPOINT_URL for an "
                            "S3-compatible store")
        if running := _running(run_url):
            raise UserError(f"run {run_url} is running now ({running}), its evaluation not written yet: run "
                            "`rlaif report` again when it has finished")
        raise UserError(f"{metrics_url} not found: is {run_url} a run directory whose evaluate stage has run?")
    metrics = read_json(metrics_url, recorded=recorded)
    if not isinstance(metrics, dict) or not isinstance(metrics.get("judges"), dict):
        raise UserError(f"{metrics_url} is not an evaluation's metrics: {storage.rerun_hint(metrics_url)}")
    malformed: list[str] = []
    return _conform(metrics, METRICS_SHAPE, "", malformed), malformed


def _fits(value, shape) -> bool:
    if shape == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if shape == INTERVAL:
        return isinstance(value, list) and len(value) == 2 and all(_fits(v, NUMBER) for v in value)
    if isinstance(shape, list):
        return isinstance(value, list) and all(_fits(v, shape[0]) for v in value)
    return isinstance(value, shape) and (shape is bool or not isinstance(value, bool))


def _conform(value: dict, shape: dict, path: str, malformed: list[str]) -> dict:
    """`value` with each field of another shape than `shape`'s left out (a mapping: empty), named in `malformed`.
    null stands for a number not measured (evaluate writes NaN as null) and is kept where a number or text goes."""
    out = dict(value)
    for key, item in value.items():
        inner, where = shape.get(key, shape.get("*")), f"{path}{key}"
        if inner is None or item is None and not isinstance(inner, (dict, list)):
            continue
        if isinstance(inner, dict):
            if not isinstance(item, dict):
                malformed.append(where)
                item = {}
            out[key] = _conform(item, inner, f"{where}.", malformed)
        elif not _fits(item, inner):
            malformed.append(where)
            del out[key]
    return out


def _manifest(stage_url: str) -> tuple[dict | None, tuple[str, str] | None]:
    """A stage's manifest for the report, or None (its rows read n/a) and, where one is there, why it cannot be read:
    damaged, or written by another version of rlaif (and the fix)."""
    try:
        return manifest.read(stage_url), None
    except UserError as exc:
        return None, _unreadable(storage.join(stage_url, manifest.MANIFEST), exc)


def _unreadable(url: str, exc: UserError) -> tuple[str, str]:
    rerun = "delete it and re-run the stage (or the pipeline)"
    try:
        found = json.loads(storage.read_bytes(url))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "is damaged (not valid JSON: cut short or overwritten)", rerun
    version = found.get("schema_version") if isinstance(found, dict) else None
    # another version writes its own schema number; a missing or non-integer one is a malformed file
    if isinstance(found, dict) and isinstance(version, int) and version != manifest.SCHEMA_VERSION:
        return (f"was written by rlaif {text(found.get('code_version'))} (manifest schema {version}), and this rlaif "
                f"{__version__} reads schema {manifest.SCHEMA_VERSION}",
                "build this report with that rlaif version, or re-run the stage with this one")
    detail = str(exc).removeprefix(url).strip().removesuffix(": delete it and re-run the stage")
    return f"is malformed ({one_line(detail, 160)})", rerun


def _optional_json(url: str) -> dict:
    try:
        found = read_json(url) if storage.exists(url) else {}
    except UserError:
        return {}
    return found if isinstance(found, dict) else {}


def _config(run_url: str) -> tuple[dict, bytes | None]:
    """config.yaml as plain data (not validated: an older run's config may name settings that are gone), and its
    bytes (None: there is none)."""
    import yaml

    url = storage.join(run_url, "config.yaml")
    if not storage.exists(url):
        return {}, None
    data = storage.read_bytes(url)
    try:
        parsed = yaml.safe_load(data)
    except yaml.YAMLError:
        parsed = None
    return (parsed if isinstance(parsed, dict) else {}), data


def load_run(run_url: str, verify: bool = True, details: bool = True) -> Run:
    """The run's files for its report. `verify`: evaluate's files must be the ones its manifest recorded (not while
    the evaluate stage itself builds the report, before its manifest is written). `details`: its examples, and its
    PPO rows required (a comparison shows no examples and reads only the last KL coefficient from the PPO rows: a
    run whose ppo/metrics.jsonl is cut short still compares)."""
    # One line for a run that cannot be read: no credentials, an unreachable endpoint, a file where a directory was.
    with user_files.user_read_errors(run_url, "run", "check the run's path (its evaluate/metrics.json and manifests "
                                  "are files)"):
        read = {stage.name: _manifest(storage.join(run_url, stage.name)) for stage in topological_order()}
        manifests = {stage: found for stage, (found, _) in read.items()}
        problems = {stage: why for stage, (_, why) in read.items() if why}
        recorded = _recorded(manifests["evaluate"]) if verify else None
        metrics, malformed = read_metrics(run_url, recorded)
        label = (_optional_json(storage.join(run_url, "label", "metrics.json")) or dig(manifests["label"], "summary")
                 or {})
        config, config_text = _config(run_url)
        examples = read_jsonl(storage.join(run_url, "evaluate", "examples.jsonl"), recorded) if details else []
        ppo_rows = _ppo_rows(run_url, required=details)
        return Run(run_url, metrics, examples, ppo_rows, manifests, label, config,
                   None if config_text is None else hashlib.sha256(config_text).hexdigest(), problems,
                   trace(manifests, problems, config_text), malformed)


def _ppo_rows(run_url: str, required: bool) -> list[dict]:
    try:
        return read_jsonl(storage.join(run_url, "ppo", "metrics.jsonl"))
    except UserError:
        if required:
            raise
        return []


def _recorded(stage_manifest: dict | None) -> dict:
    """The sha256 a stage's manifest recorded for each of its files, by name."""
    return {entry.get("path"): entry.get("sha256") for entry in dig(stage_manifest, "files") or []
            if isinstance(entry, dict)}


def stale_notes(run: Run) -> list[str]:
    """Where the results shown are not the run's current state: evaluate's manifest gone (a re-run that did not
    finish) or unreadable, an upstream output they were made from since removed or made again, config.yaml edited
    since, or metrics.json fields of another shape."""
    notes = _unverified(run) if run.manifests.get("evaluate") is None else run.lineage.notes()
    if run.malformed:
        notes.append(f"evaluate/metrics.json has fields of another shape than this rlaif writes, shown as n/a: "
                     f"{', '.join(run.malformed)} (written by another rlaif version, or edited by hand).")
    return notes


def _unverified(run: Run) -> list[str]:
    if "evaluate" not in run.problems:
        return ["These results are from an earlier evaluation of this run: evaluate has no manifest (a re-run that "
                "did not finish?), so they may not match the settings shown. Re-run the pipeline to update them."]
    why, fix = run.problems["evaluate"]
    return [f"These results are unverified: evaluate's manifest {why}, so they cannot be checked against it or against "
            f"the outputs they were made from. To fix: {fix.replace('the stage', 'evaluate')}."]

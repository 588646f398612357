"""Configs from YAML plus dotted overrides (`--set ppo.lr=1e-5`): duplicate keys, unknown keys and bad values are
errors that name the key (with the nearest real key), the settings reference (`rlaif config`), and cache keys."""
from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import re
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlaif.config.base import PATTERN_WORDS, RUN_ID_PATTERN, cache_key_dump
from rlaif.config.stages import PipelineConfig
from rlaif.errors import UserError
from rlaif.io.strict_yaml import UniqueKeyLoader


def load_yaml(text: str, source: str) -> Any:
    """YAML text as Python objects, or a one-line UserError naming `source` (syntax, duplicate keys, deep nesting)."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise UserError(f"{source} is not valid YAML: {' '.join(str(exc).split())[:200]}") from None
    except RecursionError:
        raise UserError(f"{source} is nested too deeply to be a config") from None


def safe_run_id(text: str) -> str:
    """An orchestrator's run name (e.g. Airflow's `manual__2026-11-22T08:00:00+00:00`) as a storage path segment. A
    name that had to change (characters replaced, ends trimmed, cut at 128) keeps a short hash of itself: `exp 1` and
    `exp:1`, or `實驗一` and `實驗二`, were one directory for two runs, the second replacing the first's outputs."""
    if re.fullmatch(RUN_ID_PATTERN, text):  # a run id already
        return text
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{safe[:119].rstrip('-.') or 'run'}-{digest}"


def parse_value(text: str) -> Any:
    """`--set` values are YAML scalars: 3, 0.5, true, null, "text" (integers in decimal only, as in config files)."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, RecursionError):
        return text


def refuse_repeated_keys(overrides: list[str] | tuple[str, ...]) -> None:
    """A user's own overrides giving one setting two values: the last would win without a word (a config file with a
    key twice is refused too). A mapping counts as the settings it names (`ppo={lr: 1}` sets ppo.lr). Overrides an
    orchestrator appends (typed KFP parameters) are meant to win: not checked. Items that are not strings (a KFP or
    Airflow list parameter holds any JSON) are refused first."""
    for number, item in enumerate(overrides):
        if not isinstance(item, str):
            raise UserError(f"overrides item {number} is {json.dumps(item, default=str)[:60]}, not a KEY=VALUE string: "
                            'write each override as a string, e.g. "ppo.lr=1e-4"')
    seen: dict[str, tuple[str, str]] = {}
    for item in overrides:
        parts, value = split_override(item)
        for key, setting in _settings(".".join(parts), parse_value(value)):
            shown = json.dumps(setting, sort_keys=True, default=str)  # typed: true is not 1
            if key in seen and seen[key][1] != shown:
                raise UserError(f"--set {seen[key][0]} and --set {item} set {key} to two values: give one")
            seen[key] = (item, shown)


def split_override(item: str) -> tuple[list[str], str]:
    """`section.key=VALUE` as (["section", "key"], "VALUE"), spaces around each part of the key dropped: the one
    reading of a key both the repeated-setting check and apply_overrides use."""
    if "=" not in item:
        raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set ppo.lr=1e-5")
    key, value = item.split("=", 1)
    parts = [part.strip() for part in key.split(".")]
    if not all(parts):
        raise UserError(f"--set {item!r}: the key has an empty part: write it as section.key=VALUE, e.g. "
                        "--set ppo.lr=1e-5")
    return parts, value


def _settings(key: str, value) -> list[tuple[str, object]]:
    """(dotted key, value) of each setting an override names: a mapping's own keys, flattened."""
    if isinstance(value, dict) and value:
        return [pair for sub, item in value.items() for pair in _settings(f"{key}.{sub}", item)]
    return [(key, value)]


def _merge(section: dict, value: dict) -> None:
    """A mapping given for a section sets the keys it names; the section's other settings stay as they were."""
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(section.get(key), dict):
            _merge(section[key], item)
        else:
            section[key] = item


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """`section.key=VALUE` items applied to a raw config; a mapping VALUE for a section (`ppo={lr: 1e-5}`) sets the
    keys it names and keeps the rest (every section is a model: there is no free-form mapping to replace)."""
    for item in overrides:
        parts, value = split_override(item)
        key, node = ".".join(parts), raw
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                whole = ".".join(parts[: depth + 1])
                example = f"{whole}=[a, b] (items are not set one by one)" if isinstance(child, list) else \
                    f"{whole}=VALUE"
                raise UserError(f"--set {key}: {part!r} is a value, not a section: give its whole value, e.g. "
                                f"--set {example}")
            node = child
        value = parse_value(value)
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            _merge(node[parts[-1]], value)
        else:
            node[parts[-1]] = value
    return raw


def config_fields(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) of every setting, nested sections flattened: `rlaif config` prints these."""
    rows = []
    for name, field in model.model_fields.items():
        key, kind = f"{prefix}{name}", field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            rows += config_fields(kind, f"{key}.")
            continue
        default = field.get_default(call_default_factory=True)
        type_name = getattr(kind, "__name__", None) if isinstance(kind, type) else None
        # Annotated[str, AfterValidator(...)] (a checked string) reads as str.
        shown = re.sub(r"Annotated\[(\w+), [^\]]*\]", r"\1", str(kind).replace("typing.", ""))
        rows.append((key, type_name or shown, default, " ".join((field.description or "").split())))
    return rows


# Top-level keys of a cluster file (orchestration/cluster.py's ClusterSpec; a test keeps them in step) that no
# config has: a cluster file given as --config is named as such.
CLUSTER_KEYS = {"image", "gpu_image", "namespace", "node_selector", "gpu_tolerations", "secrets", "service_account",
                "gpus_per_node", "shm_gib", "env"}


def _suggest(key: str) -> str:
    import difflib

    keys = [k for k, *_ in config_fields()]
    if key in keys:  # a dotted name written as one YAML key: 'ppo.iterations: 3' at the top level
        section, _, name = key.rpartition(".")
        return f" (a dotted name is one key in YAML: nest it, '{section}:' then '  {name}: ...' under it)"
    sections = {k.rsplit(".", 1)[0] for k in keys if "." in k}
    known = keys + sorted(sections)
    close = [k for k in known if k.lower() == key.lower()] or difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "(top level)"
    if first["type"] == "extra_forbidden" and key in CLUSTER_KEYS:
        return (f"unknown config key '{key}': it is a cluster setting (configs/cluster.yaml): give that file as "
                "--cluster, not as --config")
    if first["type"] == "extra_forbidden":
        return f"unknown config key '{key}'{_suggest(key)}: remove it or check its spelling (`rlaif config` lists them)"
    section = first["type"] in ("model_type", "model_attributes_type", "dict_type")
    if section and first.get("input") is None:
        return f"section '{key}' is empty: give it keys, or remove the line (`rlaif config` lists them)"
    if section and not any(isinstance(part, int) for part in first["loc"]):
        return f"'{key}' is a section, not a value: set its keys, e.g. {key}.<key>=VALUE (`rlaif config` lists them)"
    if first["type"] == "string_pattern_mismatch" and (words := PATTERN_WORDS.get(first["ctx"]["pattern"])):
        return f"bad value for config key '{key}': {first['input']!r} is not {words}"
    if not first["loc"]:  # a rule across sections: its message names the keys
        return first["msg"].removeprefix("Value error, ")
    message = f"bad value for config key '{key}': {first['msg'].removeprefix('Value error, ')}"
    if first["type"] == "string_type" and isinstance(first.get("input"), (bool, int, float, datetime.date)):
        message += ": put it in quotes to keep it text (YAML reads yes/no/on/off, numbers and dates as such)"
    elif (first["type"] in ("list_type", "dict_type", "model_type") and isinstance(first.get("input"), str)
          and first["input"].lstrip().startswith(("[", "{"))):  # parse_value kept the text: it is not YAML
        message += ": it was read as text, not as a YAML list or mapping: check its brackets, commas and quotes"
    elif first["type"] == "list_type" and isinstance(first.get("input"), dict):
        if all(str(item).isdigit() for item in first["input"]):  # --set key.0=x made a mapping {"0": "x"}
            message += f": items are not set one by one (key.0=...): give the whole list, e.g. {key}=[a, b]"
        else:
            message += f": it was given a mapping: give a YAML list, e.g. {key}=[a, b]"
    elif first["type"] == "list_type" and isinstance(first.get("input"), (str, int, float)):
        item = str(first["input"]).lower() if isinstance(first["input"], bool) else first["input"]
        message += f": write it as a YAML list, e.g. {key}=[{item}]"
    elif "input" in first and first["input"] is None:
        empty = " (for empty text: '')" if first["type"] == "string_type" else ""
        message += f": it was given no value (empty, or null): write one{empty}, or leave the key out for its default"
    return message


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """The config from a YAML file (local path or URL), or the defaults when there is none, plus `--set` overrides."""
    if not path:
        return parse_config("", "defaults", overrides)
    from rlaif.io.user_files import read_user_file  # local import: storage imports this module's types

    text = read_user_file(path, "config file", "give a YAML config file, e.g. configs/demo.yaml")
    return parse_config(text, f"config file {path}", overrides, given=True)


def parse_config(text: str, source: str, overrides: list[str] | tuple[str, ...] = (),
                 given: bool = False) -> PipelineConfig:
    """The config from YAML text (`source` names it in errors), plus `--set` overrides. `given`: the user named this
    text, and one that says nothing (empty, comments only, `null`, `---`) is a slip, not a wish for the defaults."""
    raw = load_yaml(text, source)
    if raw is None and given:
        raise UserError(f"{source} holds no settings: add some, or leave --config out to run the defaults")
    raw = raw or {}
    if not isinstance(raw, dict):
        raise UserError(f"{source} must hold a mapping of sections")
    raw = apply_overrides(raw, overrides)
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_describe(exc)) from None


def dump_config(cfg: PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def stage_config_hash(cfg: PipelineConfig, sections: tuple[str, ...], input_digests: dict[str, str],
                      by_content: list[str] = (), switches: dict[str, str] | None = None) -> str:
    """Cache key of a stage: its config sections (runtime fields left out), its inputs' digests and the digest of
    the code it runs. `by_content`: dotted fields (`evaluate.judges.0.constitution`) naming files whose content
    digest is among the inputs, keyed by that content and not by their path's spelling. `switches`: the computing
    switches to key with, this process's by default (`rlaif report` recomputes a committed stage's key from
    config.yaml with each it may have run under)."""
    from rlaif.io.digest import (
        code_digest,  # local import: rlaif.io imports this module
    )

    dumped = cache_key_dump(cfg)
    payload = {name: dumped[name] for name in sections}
    for field in by_content:
        _key_by_content(payload, field.split("."))
    key = {"config": payload, "inputs": input_digests, "code": code_digest()}
    switches = computing_switches(sections) if switches is None else switches
    if switches:
        key["switches"] = switches
    return sha256_json(key)


def _key_by_content(payload, path: list[str]) -> None:
    """The field at `path` of a cache-key payload (dicts, and lists by index) replaced by a marker, where the
    payload has it (a section the stage keys, a field its view kept)."""
    *parents, last = path
    for part in parents:
        payload = payload[int(part)] if isinstance(payload, list) and part.isdigit() and int(part) < len(payload) \
            else payload.get(part) if isinstance(payload, dict) else None
        if payload is None:
            return
    if isinstance(payload, dict) and last in payload:
        payload[last] = "<keyed by its content>"


# Environment variables that change what a stage computes, with their defaults and the stages (config sections) that
# read them: set to anything else, they key those stages, so a run under them never reuses, or is reused as, a run
# without them. The sampler: generate, ppo, evaluate, and train_rm's student; packed or padded forwards, and the fused
# CPU kernels or the models' own layers: the trainers and evaluate.
COMPUTING_SWITCHES = {"RLAIF_DECODER": ("auto", {"generate", "ppo", "evaluate", "train_rm"}),
                      "RLAIF_PACKING": ("on", {"train_rm", "ppo", "evaluate"}),
                      "RLAIF_CPU_KERNELS": ("on", {"train_rm", "ppo", "evaluate"})}
SWITCH_VALUES = {"RLAIF_DECODER": ("auto", "static", "generate"), "RLAIF_PACKING": ("on", "off"),
                 "RLAIF_CPU_KERNELS": ("on", "off")}  # default first


def switch(name: str) -> str:
    """The value of the switch variable `name` (SWITCH_VALUES), its default when unset; a value it cannot take is
    a one-line error."""
    allowed = SWITCH_VALUES[name]
    value = os.environ.get(name, allowed[0])
    if value not in allowed:
        raise UserError(f"{name}={value!r} is not one of {', '.join(allowed)}: unset it or pick one")
    return value


def check_switches() -> None:
    """Before any work (the stages that read them check again): a misspelt value would otherwise fail only the first
    stage that reads it, after the stages before it ran."""
    for name in SWITCH_VALUES:
        switch(name)


def computing_switches(sections: tuple[str, ...]) -> dict[str, str]:
    return {name: os.environ[name] for name, (default, readers) in COMPUTING_SWITCHES.items()
            if os.environ.get(name, default) != default and readers & set(sections)}


def possible_switches(sections: tuple[str, ...]) -> list[dict[str, str]]:
    """Every computing_switches a stage keyed on `sections` can have run under (its manifest does not record them, so
    `rlaif report` tries each)."""
    found: list[dict[str, str]] = []
    for values in itertools.product(*SWITCH_VALUES.values()):
        switches = {name: value for name, value in zip(SWITCH_VALUES, values)
                    if value != COMPUTING_SWITCHES[name][0] and COMPUTING_SWITCHES[name][1] & set(sections)}
        if switches not in found:
            found.append(switches)
    return found

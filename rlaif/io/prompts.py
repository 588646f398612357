"""The prompts, from any source `rlaif.io.prompt_sources` reads, checked row by row into the same rows
[{id, prompt, key_points?, reference?}]; and the stable held-out split."""
from __future__ import annotations

import difflib
import hashlib
import re

from rlaif.config import DataConfig, PromptColumns
from rlaif.config.base import encodable
from rlaif.errors import UserError
from rlaif.io import user_files
from rlaif.io.prompt_rows import RawRow
from rlaif.io.prompt_sources import read_source, source_digest

__all__ = ["check_splits", "is_held_out", "load_prompts", "read_demonstrations", "source_digest", "split"]

ID = re.compile(r"[A-Za-z0-9_:-]{1,128}")


def _prompt_id(record: dict, column: str, default_id: str, where: str) -> str:
    """The row's id, which becomes a shard key (a '.' would split it into file extensions, '/' into directories)."""
    pid = record.get(column)
    if pid is None:
        return default_id
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or not ID.fullmatch(str(pid)):
        raise UserError(f"{where}: id {str(pid)[:40]!r} is not usable: use 1-128 letters, digits, '-', '_' or ':' "
                        "(ids become shard keys)")
    return str(pid)


def _references(record: dict, columns: PromptColumns, where: str) -> dict:
    """A row's optional ground truth for the reference judge: key points (a list of strings), a reference (text)."""
    _no_near_miss(record, (columns.key_points, columns.reference), where)
    out = {}
    points = record.get(columns.key_points)
    if points is not None:
        if (not isinstance(points, list) or not points
                or not all(isinstance(p, str) and not user_files.is_blank(p) for p in points)):
            raise UserError(f"{where}: {columns.key_points!r} must be a non-empty list of non-empty strings (leave it "
                            "out where a prompt has none)")
        out["key_points"] = [p.strip() for p in points]
    reference = record.get(columns.reference)
    if reference is not None:
        if not isinstance(reference, str) or user_files.is_blank(reference):
            raise UserError(f"{where}: {columns.reference!r} must be a non-empty string (leave it out where a prompt "
                            "has none)")
        out["reference"] = reference
    return out


def _no_near_miss(record: dict, columns: tuple[str, ...], where: str) -> None:
    """A field spelled almost as an optional column ('keypoints', 'refrence') is refused: read as absent, it would
    quietly leave the reference judge without its ground truth."""
    for column in columns:
        if column in record:
            continue
        keys = {key.lower(): key for key in record if isinstance(key, str)}
        near = difflib.get_close_matches(column.lower(), keys, n=1, cutoff=0.8)
        if near:
            raise UserError(f"{where} has a field {keys[near[0]]!r} where {column!r} is read: rename it, or point "
                            f"data.columns at it")


NUL = "\x00"  # ends a C string: tokenizers, shard readers and terminals cut the text there
JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _prompt_text(record: object, column: str, where: str) -> str:
    if not isinstance(record, dict):
        kind = JSON_TYPES.get(type(record), type(record).__name__)
        raise UserError(f"{where} is a JSON {kind}, not an object with a {column!r} field: write each prompt as "
                        f"{{\"{column}\": \"...\"}}")
    if record.get(column) is None:
        raise UserError(f"{where} has no string field {column!r} (data.columns.prompt names the field that holds "
                        "the prompt)")
    if not isinstance(record[column], str):
        raise UserError(f"{where}: {column!r} must be a string, not {type(record[column]).__name__}")
    if user_files.is_blank(record[column]):
        raise UserError(f"{where} has an empty prompt: remove it or fill it in")
    return record[column]


def _checked(row: RawRow, data: DataConfig) -> dict:
    prompt = _prompt_text(row.record, data.columns.prompt, row.where)
    if len(prompt) > data.max_prompt_chars:
        raise UserError(f"{row.where}: prompt of {len(prompt)} characters exceeds "
                        f"data.max_prompt_chars={data.max_prompt_chars}")
    pid = _prompt_id(row.record, data.columns.id, row.default_id, row.where)
    checked = {"id": pid, "prompt": prompt.strip(), **_references(row.record, data.columns, row.where)}
    for text in (checked["prompt"], checked.get("reference", ""), *checked.get("key_points", ())):
        _unicode(text, row.where)
    return checked


def _unicode(text: str, where: str) -> None:
    if not encodable(text):
        raise UserError(f"{where}: text holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                        "valid Unicode: fix or remove that escape")
    if NUL in text:
        raise UserError(f"{where}: text holds a NUL character (U+0000), which tokenizers and readers cut the text at: "
                        "remove it")


def load_prompts(data: DataConfig) -> list[dict]:
    """[{id, prompt, key_points?, reference?}] from data.prompts in any format data.format names, with data.columns
    naming the source's columns; every problem is a one-line UserError naming the source and the row."""
    source = read_source(data)
    rows = [_checked(row, data) for row in source.rows]
    if not rows:
        raise UserError(f"{source.name} holds no prompts")
    first_row: dict[str, RawRow] = {}
    for row, checked in zip(source.rows, rows):
        if (earlier := first_row.setdefault(checked["id"], row)) is not row:
            numbered = not all(isinstance(r.record, dict) and r.record.get(data.columns.id) is not None
                               for r in (earlier, row))
            raise UserError(f"{row.where} has the prompt id {checked['id']!r} of {earlier.where}"
                            + (" (a row without an id is given one by its position)" if numbered else "")
                            + ": ids must be unique")
    _one_reference_per_text(rows, source.name)
    return rows


def _one_reference_per_text(rows: list[dict], name: str) -> None:
    """The reference judge finds a response's key points by its prompt's text: two rows of one text must agree."""
    first: dict[str, dict] = {}
    for row in rows:
        seen = first.setdefault(row["prompt"], row)
        if (seen.get("key_points"), seen.get("reference")) != (row.get("key_points"), row.get("reference")):
            raise UserError(f"{name}: prompts {seen['id']!r} and {row['id']!r} have the same text but different "
                            "references (key points are looked up by prompt text): merge them or make them agree")


def is_held_out(prompt_id: str, eval_fraction: float, salt: str = "") -> bool:
    """Stable across runs and machines: a hash of the id, not the file order, decides. Different salts give
    independent splits (the reward model's held-out pairs are drawn from the training prompts)."""
    bucket = int.from_bytes(hashlib.sha256((salt + prompt_id).encode()).digest()[:8], "big") / 2**64
    return bucket < eval_fraction


def split(data: DataConfig, which: str) -> list[dict]:
    return split_rows(load_prompts(data), data, which)


def check_splits(data: DataConfig, rows: list[dict]) -> None:
    """Both splits hold prompts (checked before any work: evaluate, the last stage, reads the eval split)."""
    for which in ("train", "eval"):
        split_rows(rows, data, which)


def split_rows(rows: list[dict], data: DataConfig, which: str) -> list[dict]:
    """The rows of one split ("train" or "eval") of the prompts `load_prompts` read. A text given more than once (under
    other ids, or differing only in case and spacing) goes where its first row's id sends it: the held-out prompts
    stay unseen by training."""
    deciding_id: dict[str, str] = {}
    for row in rows:
        deciding_id.setdefault(_same_text(row["prompt"]), row["id"])
    held = [r for r in rows
            if is_held_out(deciding_id[_same_text(r["prompt"])], data.eval_fraction) == (which == "eval")]
    if not held:
        raise UserError(f"the {which} split of {data.prompts} is empty ({len(rows)} prompts, "
                        f"data.eval_fraction={data.eval_fraction}): add prompts or adjust data.eval_fraction")
    return held


def _same_text(prompt: str) -> str:
    return " ".join(prompt.split()).casefold()


def read_demonstrations(path: str) -> list[dict]:
    """The tiny policy's supervised rows, checked (also before any work, and before a build's child process starts,
    whose errors would come back as a failed subprocess): UTF-8 JSONL objects with string 'prompt' and 'response'."""
    numbered = user_files.read_user_jsonl(path, "demonstrations file",
                                       "set policy.tiny.demonstrations to a JSONL file of prompt/response rows")
    rows = [row for _, row in numbered]
    if not rows:
        raise UserError(f"demonstrations file {path} is empty: give JSONL rows with 'prompt' and 'response'")
    for line, row in enumerate(rows, 1):
        if not (isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str)):
            raise UserError(f"demonstrations file {path}, row {line}: needs a JSON object with string 'prompt' and "
                            "'response'")
        _unicode(row["prompt"] + row["response"], f"demonstrations file {path}, row {line}")
    return rows


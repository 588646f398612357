"""Reading the prompts file and the stable held-out split."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rlaif.config import DataConfig
from rlaif.errors import UserError


def _references(row: dict, where: str) -> dict:
    """A JSONL row's optional ground truth for the reference judge: `key_points` (list of strings), `reference` (text)."""
    out = {}
    points = row.get("key_points")
    if points is not None:
        if not isinstance(points, list) or not all(isinstance(p, str) and p.strip() for p in points):
            raise UserError(f"{where}: 'key_points' must be a list of non-empty strings")
        out["key_points"] = [p.strip() for p in points]
    if row.get("reference") is not None:
        if not isinstance(row["reference"], str):
            raise UserError(f"{where}: 'reference' must be a string")
        out["reference"] = row["reference"]
    return out


def load_prompts(data: DataConfig) -> list[dict]:
    """[{id, prompt, key_points?, reference?}] from JSONL (`prompt`, optional `id`, `key_points`, `reference`) or
    plain text (one prompt per line)."""
    path = Path(data.prompts)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"prompts file not found: {path} (set data.prompts to a JSONL or text file)") from None
    except IsADirectoryError:
        raise UserError(f"prompts file {path} is a directory: set data.prompts to a JSONL or text file") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"prompts file {path} is not UTF-8 (byte {exc.start}): re-encode it as UTF-8") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"prompts file {path} line {lineno} is not valid JSON") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise UserError(f"prompts file {path} line {lineno} has no string field 'prompt'")
            prompt, pid = row["prompt"], str(row.get("id", f"line{lineno:07d}"))
            extra = _references(row, f"prompts file {path} line {lineno}")
        else:
            prompt, pid, extra = line, f"line{lineno:07d}", {}
        if len(prompt) > data.max_prompt_chars:
            raise UserError(
                f"prompts file {path} line {lineno}: prompt of {len(prompt)} characters exceeds data.max_prompt_chars={data.max_prompt_chars}"
            )
        rows.append({"id": pid, "prompt": prompt.strip(), **extra})
    if not rows:
        raise UserError(f"prompts file {path} holds no prompts")
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise UserError(f"prompts file {path} repeats prompt ids: ids must be unique")
    return rows


def is_held_out(prompt_id: str, eval_fraction: float, salt: str = "") -> bool:
    """Stable across runs and machines: a hash of the id, not the file order, decides. Different salts give
    independent splits (the reward model's held-out pairs are drawn from the training prompts)."""
    bucket = int.from_bytes(hashlib.sha256((salt + prompt_id).encode()).digest()[:8], "big") / 2**64
    return bucket < eval_fraction


def split(data: DataConfig, which: str) -> list[dict]:
    rows = load_prompts(data)
    held = [r for r in rows if is_held_out(r["id"], data.eval_fraction) == (which == "eval")]
    if not held:
        raise UserError(f"the {which} split of {data.prompts} is empty: adjust data.eval_fraction")
    return held

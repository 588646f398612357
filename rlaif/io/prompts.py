"""Reading the prompts file and the stable held-out split."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from rlaif.config import DataConfig
from rlaif.errors import UserError
from rlaif.io.storage import read_user_file

ID = re.compile(r"[A-Za-z0-9_:-]{1,128}")


def _prompt_id(row: dict, lineno: int, where: str) -> str:
    """The row's id, which becomes a shard key (a '.' would split it into file extensions, '/' into directories)."""
    pid = row.get("id")
    if pid is None:
        return f"line{lineno:07d}"
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or not ID.fullmatch(str(pid)):
        raise UserError(f"{where}: id {str(pid)[:40]!r} is not usable: use 1-128 letters, digits, '-', '_' or ':' "
                        "(ids become shard keys)")
    return str(pid)


def _references(row: dict, where: str) -> dict:
    """A JSONL row's optional ground truth for the reference judge: `key_points` (list of strings),
    `reference` (text)."""
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
    text = read_user_file(data.prompts, "prompts file", "set data.prompts to a JSONL or text file")
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
            where = f"prompts file {path} line {lineno}"
            prompt, pid, extra = row["prompt"], _prompt_id(row, lineno, where), _references(row, where)
        else:
            prompt, pid, extra = line, f"line{lineno:07d}", {}
        if not prompt.strip():
            raise UserError(f"prompts file {path} line {lineno} has an empty prompt: remove the line or fill it in")
        if len(prompt) > data.max_prompt_chars:
            raise UserError(
                f"prompts file {path} line {lineno}: prompt of {len(prompt)} characters exceeds "
                f"data.max_prompt_chars={data.max_prompt_chars}"
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

"""Constitutions: the principles a judge applies, and how a comparison picks them.

A constitution is a YAML list of principles `{name, text, contrast?}`. `contrast` describes the response the principle
argues against (Constitutional AI's "choose the response that is more X and less Y"); the embedding judge scores a
response by how much closer it is to the text than to the contrast. Principles are applied one sampled per comparison
(`sample`, seeded by the comparison's key, so results do not depend on sharding or order) or all of them, with the
judge's preferences averaged (`all`, an ensemble: k times the judge calls, no sampling noise in the label).
"""
from __future__ import annotations

import difflib
import random
import unicodedata
from typing import TYPE_CHECKING

from rlaif.config import load_yaml, sha256_json
from rlaif.errors import UserError
from rlaif.io.user_files import is_blank, read_user_file
from rlaif.judges.pairwise import debiased

if TYPE_CHECKING:  # torch only where judging happens: `rlaif launch` reads the principles without it (~2 s)
    import torch

PRINCIPLE_KEYS = ("name", "text", "contrast")


JUDGES_WITHOUT_PRINCIPLES = ("rules", "reference")  # their verdicts read no principle's text


def judge_principles(settings) -> list[dict]:
    """The principles `settings`' judge applies (label's settings or an evaluation judge's, whose errors name their
    own constitution key). The rules and reference judges read none: with `constitution: ''`, or as an evaluation's
    reference judge (whose constitution is never read), they run under one empty principle named after the judge;
    given a file that is read, its principles are checked and recorded as for any judge."""
    setting = f"{settings.setting}.constitution"
    if settings.constitution and settings.reads_constitution:
        return load_constitution(settings.constitution, setting, settings.judge in JUDGES_WITHOUT_PRINCIPLES)
    if settings.judge in JUDGES_WITHOUT_PRINCIPLES:
        return [{"name": settings.judge, "text": ""}]
    raise UserError(f"{setting} is empty: judge {settings.judge} applies a constitution's principles: set it to a YAML "
                    "list of {name, text} principles (only the rules and reference judges run without one)")


def load_constitution(path: str, setting: str = "label.constitution", optional: bool = False) -> list[dict]:
    """The principles in `path`, each {name, text} plus an optional contrast; a one-line error otherwise, naming
    `setting`, the config key that gave the path (and, where the judge reads no principles, `optional`, that it may
    be '')."""
    fix = f"set {setting} to a YAML list of principles" + (", or to '' (this judge reads none)" if optional else "")
    text = read_user_file(path, "constitution file", fix)
    principles = load_yaml(text, f"constitution {path}")
    if isinstance(principles, dict) and len(principles) == 1 and isinstance(next(iter(principles.values())), list):
        raise UserError(f"constitution {path} is a mapping with key {next(iter(principles))!r} holding the list: put "
                        "the list of {name, text} principles at the top level of the file")
    if not isinstance(principles, list) or not principles:
        raise UserError(f"constitution {path} must be a YAML list of {{name, text}} principles")
    for i, principle in enumerate(principles):
        where = f"constitution {path}, principle {i + 1}"
        unknown = sorted(map(str, set(principle) - set(PRINCIPLE_KEYS))) if isinstance(principle, dict) else []
        if unknown:  # before 'text' is required: a misspelled 'txt' is named as such
            close = difflib.get_close_matches(unknown[0], PRINCIPLE_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{where}: unknown key {unknown[0]!r}{hint}: a principle has {', '.join(PRINCIPLE_KEYS)}")
        if not isinstance(principle, dict):
            kind = "a plain string" if isinstance(principle, str) else f"a {type(principle).__name__}"
            raise UserError(f"{where} is {kind}: write each principle as a mapping, e.g. '- name: helpful' then "
                            "'  text: Prefer the response that answers the question.'")
        _check_texts(where, principle)
        if _said(principle.get("contrast", "")) == _said(principle["text"]):
            raise UserError(f"{where}: its 'contrast' repeats its 'text': describe the response it disfavours, or "
                            "leave 'contrast' out")
    given = [principle["name"] for principle in principles if "name" in principle]
    if len(set(given)) < len(given):
        twice = next(name for name in given if given.count(name) > 1)
        raise UserError(f"constitution {path}: two principles are named {twice!r} (results are reported per "
                        "principle name): give each its own name")
    # The same text and contrast twice is one principle counted twice under `principles: all`, unseen.
    seen: dict[tuple[str, str], int] = {}
    for number, principle in enumerate(principles, 1):
        key = tuple(_said(principle.get(part, "")) for part in ("text", "contrast"))
        if (first := seen.setdefault(key, number)) != number:
            raise UserError(f"constitution {path}: principles {first} and {number} say the same: keep one")
    for i, principle in enumerate(principles):  # unnamed: its text's start, numbered where two would read alike
        default = principle["text"][:40]
        if "name" not in principle:
            principle["name"] = default if default not in given else f"{default} ({i + 1})"
            given.append(principle["name"])
    return principles


MAX_NAME_CHARS = 100  # a name labels report rows and every label record


def _check_texts(where: str, principle: dict) -> None:
    """text (required), contrast and name: non-empty strings of readable text; a text or contrast with no letter or
    digit (emoji alone) says nothing a judge can weigh, and a control character (NUL) is refused as in prompts."""
    if not isinstance(principle.get("text"), str) or is_blank(principle["text"]):
        raise UserError(f"{where}: needs a non-empty string 'text' (YAML reads yes/no/on/off and numbers as "
                        "others: put such a text in quotes)")
    for key in ("text", "contrast", "name"):
        value = principle.get(key)
        if key not in principle:
            continue
        if not isinstance(value, str) or is_blank(value):
            raise UserError(f"{where}: {key!r} must be a non-empty string")
        if any(unicodedata.category(char) == "Cc" and char not in "\t\n\r" for char in value):
            raise UserError(f"{where}: its {key!r} holds a control character (a NUL?): remove it")
        if key != "name" and not any(unicodedata.category(char)[0] in "LN" for char in value):
            raise UserError(f"{where}: its {key!r} has no letters or digits, so a judge reads nothing in it: "
                            "describe the response in words")
    if len(principle.get("name", "")) > MAX_NAME_CHARS:
        raise UserError(f"{where}: its name is {len(principle['name'])} characters long: give a name of at most "
                        f"{MAX_NAME_CHARS} (the text holds the description)")


def _said(text: str) -> str:
    """What a principle's text says, for telling repeats apart: case and spacing aside."""
    return " ".join(text.lower().split())


def sample_principle(principles: list[dict], seed: int, key: str) -> dict:
    return principles[random.Random(sha256_json([seed, key])).randrange(len(principles))]


def applied(principles: list[dict], mode: str, seed: int, keys: list[str]) -> list[list[dict]]:
    """Per principle applied, one list with a principle per comparison: one sampled list, or one list per principle."""
    if mode == "all":
        return [[principle] * len(keys) for principle in principles]
    return [[sample_principle(principles, seed, key) for key in keys]]


def compare(judge, principles: list[dict], mode: str, seed: int, keys: list[str], prompts, first, second):
    """Position-debiased P(first better) under the principles `mode` applies (averaged over them for `all`), each
    order's value, whether the orders agree, and the principle names per comparison."""
    import torch

    layers = applied(principles, mode, seed, keys)
    results = [debiased(judge, prompts, first, second, [p["text"] for p in layer]) for layer in layers]
    p, p_ab, p_ba = (torch.stack([r[i] for r in results]).mean(0) for i in range(3))
    names = ["all"] * len(keys) if mode == "all" else [p["name"] for p in layers[0]]
    return p, p_ab, p_ba, (p_ab > 0.5) == (p_ba > 0.5), names


def score_each(judge, principles: list[dict], mode: str, seed: int, keys: list[str], prompts,
               responses) -> torch.Tensor:
    """d-RLAIF: each response's score in [-1, 1] under the principles `mode` applies (averaged for `all`)."""
    if not hasattr(judge, "direct_score"):
        raise UserError(f"judge {judge.name} cannot score one response alone: use judge hf, rules or reference with "
                        "label.mode=score")
    import torch

    layers = applied(principles, mode, seed, keys)
    return torch.stack([judge.direct_score(prompts, responses, [p["text"] for p in layer]) for layer in layers]).mean(0)

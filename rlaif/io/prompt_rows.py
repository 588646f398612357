"""What every prompts reader produces (raw rows, each with the place an error names and the id a row without one
gets) and the helpers the readers share: prompt_sources (files) and hf_datasets (Hugging Face datasets)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import PurePosixPath

from rlaif.config import PromptColumns
from rlaif.errors import UserError

FIX = ("set data.prompts to a JSONL, CSV, text or parquet file, or a dataset directory saved with datasets' "
       "save_to_disk")


@dataclass
class RawRow:
    where: str  # how errors name the row: "prompts file X line 3"
    default_id: str  # a row without an id gets its line or row number: a JSONL file and its parquet twin agree
    record: object  # the row's columns; a JSONL line may hold any JSON value, and the validator says what is wrong


@dataclass
class Source:
    name: str  # how errors name the whole source: "prompts file X", "prompts dataset X (split train)"
    rows: list[RawRow]


def suffix_of(url: str) -> str:
    return PurePosixPath(url.split("://", 1)[-1]).suffix.lower()


def has_glob(url: str) -> bool:
    return any(c in url for c in "*?[")


def import_extra(module: str, fmt: str):
    """A module of the `datasets` extra, or a one-line UserError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"data.format {fmt} needs the {module.split('.')[0]} package: "
                        'pip install "rlaif[datasets]"') from None


def numbered_rows(name: str, unit: str, records: list) -> list[RawRow]:
    return [RawRow(f"{name} {unit} {i}", f"line{i:07d}", record) for i, record in enumerate(records, 1)]


def wanted_columns(name: str, available: list[str], columns: PromptColumns, other_reading: str = "") -> list[str]:
    """The mapped columns the source has. The prompt column must be there, and so must any column data.columns names
    explicitly; the optional ones under their default names may be absent. `other_reading`: a further fix for a
    missing prompt column (a file whose format was guessed)."""
    defaults = PromptColumns()
    for field, column in columns.model_dump().items():
        if column not in available and (field == "prompt" or column != getattr(defaults, field)):
            further = f", {other_reading}" if field == "prompt" and other_reading else ""
            raise UserError(f"{name} has no column {column!r} (it has {', '.join(map(repr, available))[:200]}): set "
                            f"data.columns.{field} to the column that holds the {field.replace('_', ' ')}{further}")
    return [column for column in columns.model_dump().values() if column in available]

"""Where a run's data lives and where its prompts come from: the storage root and the prompts' source, columns and
splits."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlaif.config.base import Strict, no_credentials, refuse_edge_space


class StorageConfig(Strict):
    root: str = Field("file://./runs", min_length=1)
    """Where run outputs live: `file://PATH` (relative paths resolve against the working directory) or `s3://bucket/prefix`."""
    endpoint_url: str | None = None
    """S3 endpoint (MinIO, moto, ...). Falls back to the AWS_ENDPOINT_URL environment variable. Credentials come only
    from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an instance role), never from config."""

    @field_validator("root", "endpoint_url")
    @classmethod
    def _url(cls, v: str | None, info) -> str | None:
        no_credentials(v, paths=info.field_name == "root")
        if v and v.startswith("s3://") and not v[len("s3://"):].split("/")[0]:
            raise ValueError("an s3:// URL needs a bucket: s3://BUCKET/prefix")
        return v


class PromptColumns(Strict):
    """Which column (JSONL field) of the prompts holds each of our fields; each defaults to the field's own name, so a
    file already in our layout needs nothing here. Only prompt is required; the others may be absent."""

    prompt: str = Field("prompt", min_length=1, max_length=256)
    """Column holding the prompt text (a string in every row)."""
    id: str = Field("id", min_length=1, max_length=256)
    """Column holding a stable prompt id (letters, digits, '-', '_', ':'); rows without one are numbered by their line
    or row, so the held-out split stays the same when a file moves between formats."""
    key_points: str = Field("key_points", min_length=1, max_length=256)
    """Column holding the key points a good answer makes (a list of strings), for the reference judge."""
    reference: str = Field("reference", min_length=1, max_length=256)
    """Column holding a reference answer (a string), for the reference judge."""

    @model_validator(mode="after")
    def _distinct(self):
        named = [self.prompt, self.id, self.key_points, self.reference]
        if len(set(named)) != len(named):
            raise ValueError(f"two of our fields read the same column: {named}")
        return self


class DataConfig(Strict):
    prompts: str = Field("data/prompts.jsonl", min_length=1)
    """Where the prompts are: a path, file:// or s3:// URL of a JSONL, plain-text or parquet file, of a directory
    saved with `datasets`' save_to_disk, or of parquet/JSONL files for `datasets` (a glob; data.format hf); or a
    Hugging Face Hub dataset (`hf://datasets/ORG/NAME`, or `ORG/NAME` with data.format hf; the hub must be
    reachable and HF_HUB_OFFLINE unset)."""
    format: Literal["auto", "jsonl", "text", "parquet", "csv", "hf"] = "auto"
    """How to read data.prompts. auto: by suffix (.jsonl/.json/.ndjson/.jsonlines: jsonl, .txt: text, .parquet:
    parquet, .csv/.tsv: csv with a header row, key points as a JSON list), a directory or an hf:// URL: hf, any other
    file: jsonl when its first line is a JSON object, else text (one prompt per line); a compressed file is refused.
    parquet and hf need the `datasets` extra."""
    columns: PromptColumns = PromptColumns()
    """The dataset's column names for our fields (JSONL, parquet and hf; plain text has only prompts)."""
    split: str = Field("train", min_length=1, max_length=128)
    """hf: the split to read from a saved DatasetDict, data files or a hub dataset (a saved single Dataset has none)."""
    revision: str | None = Field(None, min_length=1, max_length=256)
    """hf, hub datasets only: the git revision (branch, tag or commit) to load; a commit makes the run repeatable."""
    data_files: str | list[str] | None = None
    """hf, hub datasets only: which of the repository's files to load (a path or glob, or a list of them)."""
    eval_fraction: float = 0.1
    """Fraction of prompts held out for evaluation, chosen by a hash of the prompt id (stable across runs)."""
    max_prompt_chars: int = Field(2000, ge=1, le=1_000_000)
    """Prompts longer than this are refused with an error naming the prompt (at most 1,000,000: a served policy takes
    requests of up to 16 MiB)."""

    @field_validator("prompts")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        return no_credentials(v, paths=True)  # a glob's '?', a file name's '#'

    @field_validator("data_files")
    @classmethod
    def _files(cls, v: str | list[str] | None) -> str | list[str] | None:
        for name in [v] if isinstance(v, str) else v or []:
            refuse_edge_space(name)
        return v

    @field_validator("eval_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 < v < 1.0:
            raise ValueError("must be between 0 and 1 (exclusive)")
        return v

    @model_validator(mode="after")
    def _hub_settings(self):
        if (self.revision or self.data_files) and self.format not in ("auto", "hf"):
            raise ValueError(f"revision and data_files apply to Hugging Face Hub datasets, not data.format "
                             f"{self.format}")
        return self

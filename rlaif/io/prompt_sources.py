"""Where prompts come from: JSONL, plain text, parquet or a Hugging Face dataset (a directory saved with
save_to_disk, parquet/JSONL data files, or a hub dataset), from a local path or an s3:// URL.

Each reader turns its source into the same raw rows, each with the place an error names and the id a row without
one gets; `rlaif.io.prompts` validates them, so every format has the same checks and the same one-line messages.
pyarrow and datasets (the `datasets` extra) are imported only when a source needs them."""
from __future__ import annotations

import csv
import io
import json

from rlaif.config import DataConfig, PromptColumns, sha256_json
from rlaif.errors import UserError
from rlaif.io import storage, user_files
from rlaif.io.digest import spec_digest
from rlaif.io.hf_datasets import hub_digest, is_hub, read_hf
from rlaif.io.prompt_rows import FIX, RawRow, Source, has_glob, import_extra, numbered_rows, suffix_of, wanted_columns

SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".jsonlines": "jsonl", ".txt": "text",
                  ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}
COMPRESSED = {".gz": "gunzip", ".bz2": "bunzip2", ".xz": "unxz", ".zst": "unzstd", ".zip": "unzip", ".7z": "7z x"}
# Files a path may name by mistake (the constitution, a config, the README): read as text, every line a prompt.
NOT_PROMPTS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".ini": "a settings file", ".cfg": "a settings file",
               ".md": "Markdown", ".rst": "reStructuredText", ".html": "HTML", ".htm": "HTML", ".xml": "XML",
               ".py": "Python", ".sh": "a shell script", ".pdf": "a PDF", ".docx": "a Word document",
               ".xlsx": "a spreadsheet", ".safetensors": "model weights", ".bin": "a binary file"}

# Listing, globbing or copying a dataset on s3:// fails as OSError kinds: one line, as for a single file.
STORAGE_FIX = "check data.prompts and the storage credentials"


def read_source(data: DataConfig) -> Source:
    """The raw rows of data.prompts, read as data.format says. auto: as its name implies (named_format); another
    file is jsonl when its first line is a JSON object (a JSONL file by another name would otherwise be read as
    prompts of raw JSON), else text."""
    with user_files.user_read_errors(data.prompts, "prompts", STORAGE_FIX, also=("hf",)):
        named = named_format(data)
        fmt = named or ("jsonl" if _starts_with_a_json_object(data.prompts) else "text")
        if fmt != "hf" and data.split != "train":  # a file of one kind has no splits: the setting would be ignored
            raise UserError(f"data.split {data.split!r} picks a split of a Hugging Face dataset, and {data.prompts} is "
                            f"read as one {fmt} file with no splits: unset data.split, or give the split's own file")
        if fmt == "text":
            return _read_text(data)
        if fmt == "jsonl":
            return _read_jsonl(data.prompts, sniffed=named is None)
        if fmt == "parquet":
            return _read_parquet(data)
        if fmt == "csv":
            return _read_csv(data)
        return read_hf(data)


def named_format(data: DataConfig) -> str | None:
    """The format data.format or the prompts' name implies (suffix, hf:// URL, directory); None for a file of another
    name, whose first line decides (read_source)."""
    if data.format != "auto":
        return data.format
    if data.prompts.startswith("hf://"):
        return "hf"
    suffix = suffix_of(data.prompts)
    if has_glob(data.prompts) and not storage.exists(data.prompts):  # a file may have '[' in its name
        raise UserError(f"prompts {data.prompts} is a glob, which data.format=hf reads (all matching parquet or JSONL "
                        "files as one dataset): set data.format=hf, or name one file")
    if suffix in COMPRESSED and not has_glob(data.prompts):
        raise UserError(f"prompts file {data.prompts} is compressed ({suffix}): decompress it first "
                        f"({COMPRESSED[suffix]}) and point data.prompts at the result")
    if (fmt := SUFFIX_FORMATS.get(suffix)) is not None:
        return fmt
    if suffix in NOT_PROMPTS:
        raise UserError(f"prompts file {data.prompts} looks like {NOT_PROMPTS[suffix]}, not prompts: {FIX}; or set "
                        "data.format=text to read it as one prompt per line")
    return "hf" if storage.is_dir(data.prompts) else None


def reading(data: DataConfig) -> str:
    """What decides, besides the content, how the prompts are read: data.format and, under auto, the name's suffix
    (the same bytes as p.txt and p.csv are other prompts). No storage call, unlike named_format."""
    return f"{data.format} {suffix_of(data.prompts)}"


def _starts_with_a_json_object(url: str) -> bool:
    if storage.is_local(url) and not storage.local_path(url).is_file():
        return False  # missing, or a FIFO a read would block on: the text reader names it
    with storage.open_url(url) as f:
        head = f.read(1 << 16).decode("utf-8-sig", errors="replace")  # a first line longer: text
    first = next((line for line in user_files.text_lines(head) if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


def source_digest(data: DataConfig) -> str:
    """The prompts' content for the cache key: a file's or a saved dataset directory's (s3://: its objects' ETags and
    sizes), every file a glob matches, or a hub dataset's resolved commit."""
    with user_files.user_read_errors(data.prompts, "prompts", STORAGE_FIX, also=("hf",)):
        return _source_digest(data)


def _source_digest(data: DataConfig) -> str:
    if named_format(data) != "hf":  # a file's digest is its bytes', whatever it is read as
        return spec_digest(data.prompts)
    if is_hub(data):
        return hub_digest(data)
    if has_glob(data.prompts):  # only hf reads globs: elsewhere '[' is part of a file's name
        return sha256_json([[url, spec_digest(url)] for url in storage.glob(data.prompts)])
    return spec_digest(data.prompts)


def _read_text(data: DataConfig) -> Source:
    if data.columns != PromptColumns():
        raise UserError(f"data.columns is set but {data.prompts} is read as plain text (one prompt per line, no "
                        "columns): name a .jsonl or .parquet file, or set data.format")
    name = f"prompts file {data.prompts}"
    lines = user_files.text_lines(user_files.read_user_file(data.prompts, "prompts file", FIX))
    if data.format == "auto":  # a .txt name; data.format=text reads any lines as prompts
        _check_not_rows(name, [line for line in lines if not user_files.is_blank(line)], data.columns.prompt)
    return Source(name, [RawRow(f"{name} line {n}", f"line{n:07d}", {"prompt": line})
                         for n, line in enumerate(lines, 1) if not user_files.is_blank(line)])


def _check_not_rows(name: str, lines: list[str], prompt_column: str) -> None:
    """A .txt file whose lines are rows of another format (JSON Lines, or a CSV with a header naming the prompt
    column) would give prompts of raw JSON or CSV: refused, with the format to name."""
    if not lines:
        return
    header = next(csv.reader([lines[0]]), [])
    if len(header) > 1 and prompt_column in (cell.strip() for cell in header):
        fmt, found = "csv", "a CSV (its first line is a header naming the prompt column)"
    elif all(user_files.is_json_object(line) for line in lines[:1000]):
        fmt, found = "jsonl", "JSON Lines (each line a JSON object)"
    else:
        return
    raise UserError(f"{name} holds {found}, which plain text would read as raw prompts: rename it .{fmt} or set "
                    f"data.format={fmt} (data.format=text reads every line as a prompt)")


def _check_not_one_object(name: str, text: str) -> None:
    """A whole file that is one JSON object over several lines ({"data": [...]}, as many exports write): JSONL's
    line-by-line error (column 2 of line 1) would not say so."""
    if len([line for line in user_files.text_lines(text) if line.strip()]) < 2:
        return
    try:
        whole = json.loads(text)
    except ValueError:
        return
    if isinstance(whole, dict):
        lists = [key for key, value in whole.items() if isinstance(value, list)]
        where = f": its {lists[0]!r} holds a list" if lists else ""
        raise UserError(f"{name} is one JSON object (keys {', '.join(map(repr, whole))[:120]}){where}, not a row per "
                        "line: write the rows as JSON Lines (one object per line) or as a .json array")


def _read_jsonl(url: str, sniffed: bool = False) -> Source:
    """One JSON object per line; a .json file holding one JSON array is read as its items. `sniffed`: read as JSONL
    for its first line, a JSON object, which an error says."""
    name, text = f"prompts file {url}", user_files.read_user_file(url, "prompts file", FIX)
    if suffix_of(url) == ".json" and text.lstrip().startswith("["):
        return Source(name, numbered_rows(name, "item", user_files.parse_json(text, name)))
    _check_not_one_object(name, text)
    try:
        rows = user_files.parse_jsonl(text, name)
    except UserError as exc:
        if not sniffed:
            raise
        raise UserError(f"{exc} (read as JSON Lines because its first line is a JSON object: set data.format=text "
                        "to read one prompt per line)") from None
    return Source(name, [RawRow(f"{name} line {number}", f"line{number:07d}", record) for number, record in rows])


def _read_parquet(data: DataConfig) -> Source:
    pyarrow, parquet = import_extra("pyarrow", "parquet"), import_extra("pyarrow.parquet", "parquet")
    name = f"prompts file {data.prompts}"
    raw = user_files.read_user_bytes(data.prompts, "prompts file", FIX)  # bytes: the same for a path and s3://
    try:
        table = parquet.read_table(pyarrow.BufferReader(raw))
    except (pyarrow.ArrowException, OSError) as exc:
        raise UserError(f"{name} is not a parquet file ({storage.first_line(exc)[:200]}): {FIX}") from None
    records = table.select(wanted_columns(name, table.column_names, data.columns)).to_pylist()
    return Source(name, numbered_rows(name, "row", records))


def _read_csv(data: DataConfig) -> Source:
    """A CSV file (TSV for .tsv) whose first row names the columns; a key-points cell holds a JSON list."""
    name = f"prompts file {data.prompts}"
    text = user_files.read_user_file(data.prompts, "prompts file", FIX)
    # strict: a quoted cell never closed is an error, where it would swallow every row after it into one prompt.
    dialect = {"strict": True}
    if suffix_of(data.prompts) == ".tsv":
        # TSV has no quoting (a prompt may start with a quote mark), unless the export quoted its header's cells too.
        header = next(iter(user_files.text_lines(text)), "").split("\t")
        quoted = all(len(cell) > 1 and cell[0] == cell[-1] == '"' for cell in header)
        dialect = {"delimiter": "\t", **({"strict": True} if quoted else {"quoting": csv.QUOTE_NONE})}
    csv.field_size_limit(max(csv.field_size_limit(), 4 * data.max_prompt_chars))  # a cell as long as a prompt
    try:
        table = list(csv.reader(io.StringIO(text, newline=""), **dialect))
    except csv.Error as exc:
        raise UserError(f"{name} is not valid CSV ({exc}): close each quoted cell, and double a quote inside one "
                        "(\"\")") from None
    header, *body = table or [[]]
    _check_delimiter(name, header, data.columns.prompt)
    if len(set(header)) != len(header):
        raise UserError(f"{name}'s header row names a column twice ({', '.join(map(repr, header))[:200]}): rename one")
    text_instead = "or set data.format=text to read one prompt per line" if data.format == "auto" else ""
    wanted = wanted_columns(f"{name} (read as CSV: its first row is the header)", header, data.columns, text_instead)
    rows = []
    for number, cells in enumerate(body, 2):
        if not any(cell.strip() for cell in cells):
            continue
        if len(cells) != len(header):
            raise UserError(f"{name} row {number - 1} has {len(cells)} cells and the header {len(header)}: quote "
                            "cells that hold the delimiter, or fix the row")
        # an empty cell is a value left out (CSV has no null), except the prompt's, which the checks refuse
        record = {column: cell if cell.strip() or column == data.columns.prompt else None
                  for column, cell in zip(header, cells) if column in wanted}
        points = data.columns.key_points
        if record.get(points) is not None:
            record[points] = user_files.parse_json(record[points], f"{name} row {number - 1} column {points!r}")
        rows.append(RawRow(f"{name} row {number - 1}", f"line{number - 1:07d}", record))
    return Source(name, rows)


def _check_delimiter(name: str, header: list[str], prompt_column: str) -> None:
    """A header read as one column that another separator would split into the prompt column: a semicolon- or
    pipe-separated export (spreadsheets in many locales), which renaming a column cannot fix."""
    if len(header) != 1 or prompt_column in header:
        return
    for separator in (";", "|", "\t"):
        if prompt_column in (cell.strip() for cell in header[0].split(separator)):
            raise UserError(f"{name}'s header {header[0][:80]!r} is separated by {separator!r}: CSV here is "
                            "comma-separated (tab-separated in a .tsv file): export it so")

"""Prompts from a Hugging Face dataset: a hub dataset, parquet or JSONL data files (one file or a glob, local or
s3://) through datasets' own loaders, or a directory written by save_to_disk. datasets (the `datasets` extra) is
imported only when a source needs it; prompt_sources.read_source sends data.format hf here."""
from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rlaif.config import DataConfig, PromptColumns
from rlaif.errors import UserError, one_line
from rlaif.io import hub, storage
from rlaif.io.prompt_rows import FIX, Source, has_glob, import_extra, numbered_rows, suffix_of, wanted_columns

DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}  # datasets' loader per suffix
SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (DatasetDict, Dataset)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def read_hf(data: DataConfig) -> Source:
    """A hub dataset, parquet/JSONL data files (a file or a glob) through datasets' loaders, or a saved directory."""
    if is_hub(data):
        return _read_hub(data)
    if data.revision or data.data_files:
        raise UserError(f"data.revision and data.data_files apply to Hugging Face Hub datasets, and {data.prompts} "
                        "is not one: unset them, or write the hub dataset as hf://datasets/ORG/NAME")
    if has_glob(data.prompts) or suffix_of(data.prompts) in DATA_FILE_BUILDERS:
        return _read_data_files(data)
    return _read_saved(data)


def is_hub(data: DataConfig) -> bool:
    """hf:// URLs, and with data.format hf a bare ORG/NAME that is not a local path."""
    url = data.prompts
    if url.startswith("hf://"):
        return True
    return (data.format == "hf" and "://" not in url and HUB_ID.fullmatch(url) is not None
            and suffix_of(url) not in DATA_FILE_BUILDERS and not Path(url).exists())


def hub_repo(url: str) -> str:
    repo = url.removeprefix("hf://").removeprefix("datasets/").strip("/")
    if not HUB_ID.fullmatch(repo):
        raise UserError(f"prompts {url!r} is not a Hugging Face Hub dataset name: write hf://datasets/ORG/NAME")
    return repo


def hub_offline() -> bool:
    """Offline mode for datasets: HF_HUB_OFFLINE (as for models, io/hub.py) or datasets' own HF_DATASETS_OFFLINE."""
    return hub.offline() or os.environ.get("HF_DATASETS_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def _datasets():
    datasets = import_extra("datasets", "hf")
    datasets.disable_progress_bars()  # a failed launch prints one line, not a progress bar per split
    datasets.logging.set_verbosity_error()
    return datasets


def _loaded(name: str, load: Callable):
    """datasets raises many kinds of error for a bad dataset (FileNotFoundError, ValueError, its own): one line each."""
    try:
        return load()
    except UserError:
        raise
    except Exception as exc:
        cause = exc
        while cause.__cause__ is not None or cause.__context__ is not None:  # DatasetGenerationError wraps the reason
            cause = cause.__cause__ or cause.__context__
        reason = one_line(cause) or type(cause).__name__
        raise UserError(f"{name} cannot be loaded ({type(cause).__name__}: {reason})") from None


def _saved_split(local: Path, split: str, name: str) -> tuple[Path, str]:
    """The directory of the Dataset to load (a saved DatasetDict's: data.split's own, so that another split saved with
    no rows, which load_from_disk cannot read, does not stop it) and its name for errors."""
    if (local / "dataset_dict.json").exists():
        splits = _loaded(name, lambda: json.loads((local / "dataset_dict.json").read_text())["splits"])
        if not splits:
            raise UserError(f"{name} is a DatasetDict with no splits: save the dataset with its prompts")
        if split not in splits:
            raise UserError(f"{name} has splits {sorted(splits)}, not {split!r}: set data.split")
        local, name = local / split, f"{name} (split {split})"
    elif split != "train":
        raise UserError(f"data.split {split!r} picks a split of a saved DatasetDict, and {name} is a single "
                        "Dataset with no splits: unset data.split")
    try:
        saved_files = json.loads((local / "state.json").read_text()).get("_data_files")
    except (OSError, ValueError, AttributeError):
        return local, name  # load_from_disk names what is wrong
    if saved_files == []:  # save_to_disk wrote no data file: load_from_disk would fail with an IndexError
        raise UserError(f"{name} holds no prompts (saved with no rows): save the dataset with its prompts")
    return local, name


def _dataset_source(name: str, dataset, columns: PromptColumns) -> Source:
    records = dataset.select_columns(wanted_columns(name, dataset.column_names, columns)).to_list()
    return Source(name, numbered_rows(name, "row", records))


def _read_hub(data: DataConfig) -> Source:
    repo, name = hub_repo(data.prompts), f"prompts dataset {data.prompts} (split {data.split})"
    datasets = _datasets()
    if hub_offline() or getattr(datasets.config, "HF_HUB_OFFLINE", False):
        raise UserError(f"{name} is on the Hugging Face Hub, which is off here (HF_HUB_OFFLINE): save it with "
                        "datasets' save_to_disk where the hub is reachable and set data.prompts to that directory "
                        "(local or s3://), or set HF_HUB_OFFLINE=0")
    dataset = _loaded(name, lambda: datasets.load_dataset(repo, split=data.split, revision=data.revision,
                                                          data_files=data.data_files))
    return _dataset_source(name, dataset, data.columns)


def hub_digest(data: DataConfig) -> str:
    """The commit the revision resolves to (a moving branch re-runs the stages when it moves); where the hub cannot
    be asked, the revision as written (loading then says why it cannot read the dataset)."""
    pinned = f"hf-hub:{data.prompts}@{data.revision or 'main'}"
    if hub_offline():
        return pinned
    try:
        from huggingface_hub import HfApi

        return f"hf-hub:{data.prompts}@{HfApi().dataset_info(hub_repo(data.prompts), revision=data.revision).sha}"
    except Exception:  # unreachable, unknown repo, no huggingface_hub: loading reports it in one line
        return pinned


@contextmanager
def _scratch() -> Iterator[Path]:
    """A private directory per load under the rlaif cache, removed after: torchrun ranks load the same prompts at
    once, and datasets' own cache would grow by a copy per load."""
    storage.cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="prompts-", dir=storage.cache_dir()) as tmp:
        yield Path(tmp)


def _read_data_files(data: DataConfig) -> Source:
    """Parquet or JSONL files (a glob may name several) through datasets' own loaders, in sorted order."""
    url, name = data.prompts, f"prompts dataset {data.prompts} (split {data.split})"
    builder = DATA_FILE_BUILDERS.get(suffix_of(url))
    if builder is None:
        raise UserError(f"{name}: data.format hf reads .parquet, .jsonl or .json data files, a saved dataset "
                        "directory or a hub dataset")
    matches = storage.glob(url)
    if not matches:
        raise UserError(f"prompts not found: no file matches {url} ({FIX})")
    datasets = _datasets()
    with _scratch() as scratch:
        files = _local_files(matches, scratch)
        dataset = _loaded(name, lambda: datasets.load_dataset(builder, data_files=files, split=data.split,
                                                              cache_dir=str(scratch / "cache"), keep_in_memory=True))
        return _dataset_source(name, dataset, data.columns)


def _local_files(matches: list[str], scratch: Path) -> list[str]:
    """Local paths of the matched files, s3:// ones copied into `scratch` (a folder each: two prefixes may hold
    files of the same name)."""
    paths = []
    for i, url in enumerate(matches):
        if storage.is_local(url):
            paths.append(str(storage.local_path(url)))
            continue
        parent, _, file = url.rpartition("/")
        storage.copy_to_local(parent, [file], scratch / f"{i:05d}")
        paths.append(str(scratch / f"{i:05d}" / file))
    return paths


def _read_saved(data: DataConfig) -> Source:
    """A directory written by save_to_disk (a Dataset, or a DatasetDict whose data.split is read); an s3:// one is
    copied to a private local directory first."""
    url, name = data.prompts, f"prompts dataset {data.prompts}"
    if not storage.is_dir(url):
        if not storage.exists(url):
            raise UserError(f"prompts not found: {url} ({FIX})")
        raise UserError(f"prompts file {url} is read as a dataset directory (data.format hf) but is a file: {FIX}")
    files = storage.list_files(url)
    if not any(marker in files for marker in SAVED_DATASET_MARKERS):
        data_files = sorted({suffix_of(name) for name in files} & set(DATA_FILE_BUILDERS))
        if data_files:
            raise UserError(f"prompts {url} is a directory of {data_files[0]} files, not a dataset saved with save_to_"
                            f"disk: read them all with data.prompts={url.rstrip('/')}/*{data_files[0]} and "
                            "data.format=hf, or name one file")
        raise UserError(f"prompts file {url} is not a regular file (a directory, FIFO or device), nor a dataset saved "
                        f"with datasets' save_to_disk (no {' or '.join(SAVED_DATASET_MARKERS)} in it): {FIX}")
    datasets = _datasets()
    with _scratch() as scratch:
        local = storage.local_path(url)
        if not storage.is_local(url):
            storage.copy_to_local(url, files, scratch)
            local = scratch
        local, name = _saved_split(local, data.split, name)
        dataset = _loaded(name, lambda: datasets.load_from_disk(str(local), keep_in_memory=True))
        return _dataset_source(name, dataset, data.columns)

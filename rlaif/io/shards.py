"""WebDataset shards: writing, and streaming reads that verify each shard's sha256 and split across ranks/workers.

Sample fields ending in `.txt` are str, `.json` are JSON objects; `__key__` is the sample key.
"""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_iterator

from rlaif.errors import UserError
from rlaif.io import storage

storage.register_webdataset_s3()


def _encode(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value, sort_keys=True).encode("utf-8")


def _decode(name: str, data: bytes):
    if name.endswith(".txt"):
        return data.decode("utf-8")
    if name.endswith(".json"):
        return json.loads(data)
    return data


class ShardWriter:
    """Writes `shard-%06d.tar` files of at most `shard_size` samples under `stage_url` (a local temp file per shard,
    then one upload), and records each shard's name, count, byte size and sha256 for the manifest. `on_shard` is
    called with each shard's record once the shard is in storage (a streaming reader may open it from then on)."""

    def __init__(self, stage_url: str, shard_size: int, first_index: int = 0,
                 on_shard: Callable[[dict], None] | None = None):
        self.stage_url = stage_url
        self.shard_size = shard_size
        self.index = first_index
        self.on_shard = on_shard
        self.shards: list[dict] = []
        self._tmpdir = tempfile.TemporaryDirectory(prefix="rlaif-shards-")
        self._writer = None
        self._count = 0

    def write(self, sample: dict) -> None:
        if "__key__" not in sample:
            raise ValueError("sample needs a __key__")
        if self._writer is None:
            self._path = Path(self._tmpdir.name) / f"shard-{self.index:06d}.tar"
            # A fixed mtime makes shards byte-identical for identical samples, so digests (and caches) are reproducible.
            self._writer = wds.TarWriter(str(self._path), mtime=0)
            self._count = 0
        self._writer.write({k: v if k == "__key__" else _encode(v) for k, v in sample.items()})
        self._count += 1
        if self._count >= self.shard_size:
            self._flush()

    def _flush(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        name = self._path.name
        storage.upload_file(self._path, storage.join(self.stage_url, name))
        self.shards.append(
            {"url": name, "count": self._count, "bytes": self._path.stat().st_size,
             "sha256": storage.sha256_file(self._path)}
        )
        self._path.unlink()
        self._writer = None
        self.index += 1
        if self.on_shard:
            self.on_shard(self.shards[-1])

    def close(self) -> list[dict]:
        self._flush()
        self._tmpdir.cleanup()
        return self.shards

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            self._tmpdir.cleanup()


class _HashingReader(io.RawIOBase):
    """Passes bytes through while hashing them, so a shard is verified as it streams."""

    def __init__(self, raw):
        self.raw = raw
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        self.sha.update(data)
        self.nbytes += len(data)
        buffer[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def iter_shard(stage_url: str, shard: dict) -> Iterator[dict]:
    """Samples of one shard, decoded; raises UserError if the shard is missing, malformed or fails its checksum."""
    url = storage.join(stage_url, shard["url"])
    try:
        raw = storage.open_url(url, "rb")
    except FileNotFoundError:
        raise UserError(f"shard {url} is listed in its manifest but missing: {storage.rerun_hint(url)}") from None
    reader = _HashingReader(raw)
    count = 0
    try:
        stream = io.BufferedReader(reader, buffer_size=1 << 20)
        files = (dict(f, __url__=url) for f in tar_file_iterator(stream))
        for sample in group_by_keys(files):
            count += 1
            yield {k: v if k.startswith("__") else _decode(k, v) for k, v in sample.items()}
        stream.read()  # the tar's end padding is part of the checksum
        reader.drain()
    except (OSError, ValueError, KeyError, tarfile.TarError) as exc:  # JSON/Unicode errors are ValueErrors
        raise UserError(f"shard {url} is malformed ({type(exc).__name__}: {exc}): "
                        + storage.rerun_hint(url)) from None
    finally:
        raw.close()
    if reader.sha.hexdigest() != shard["sha256"] or count != shard["count"]:
        raise UserError(f"shard {url} fails its manifest checksum (corrupted or overwritten): "
                        + storage.rerun_hint(url))


def split_assignment(shards: list[dict], slot: int, num_slots: int) -> tuple[list[int], bool]:
    """Which shards a reader slot opens, and whether it must then keep only every num_slots-th sample.

    With at least as many shards as slots, whole shards are dealt round-robin; otherwise every slot reads every
    shard and keeps the samples whose global index falls to it. Either way each sample goes to exactly one slot."""
    if len(shards) >= num_slots:
        return [i for i in range(len(shards)) if i % num_slots == slot], False
    return list(range(len(shards))), True


def read_samples(
    stage_url: str, manifest: dict, rank: int = 0, world_size: int = 1, worker: int | None = None,
    num_workers: int | None = None
) -> Iterator[dict]:
    """Stream the samples of a stage output for one (rank, DataLoader worker) slot, verifying each shard."""
    if worker is None or num_workers is None:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
    slot, num_slots = rank * num_workers + worker, world_size * num_workers
    shard_ids, by_sample = split_assignment(manifest["shards"], slot, num_slots)
    offsets = [0]
    for shard in manifest["shards"]:
        offsets.append(offsets[-1] + shard["count"])
    for i in shard_ids:
        for j, sample in enumerate(iter_shard(stage_url, manifest["shards"][i])):
            if not by_sample or (offsets[i] + j) % num_slots == slot:
                yield sample


def read_all(stage_url: str, manifest: dict) -> list[dict]:
    return list(read_samples(stage_url, manifest, 0, 1, 0, 1))


def shuffled(samples: Iterator[dict], buffer_size: int, rng) -> Iterator[dict]:
    """A shuffle buffer: memory bounded by buffer_size, order decided by `rng` (a random.Random)."""
    buffer: list[dict] = []
    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= buffer_size:
            i = rng.randrange(len(buffer))
            buffer[i], buffer[-1] = buffer[-1], buffer[i]
            yield buffer.pop()
    rng.shuffle(buffer)
    yield from buffer


def shuffled_stream(stage_url: str, manifest: dict, seed, buffer_size: int) -> Iterator[dict]:
    """Every sample once, in an order fixed by `seed`: shards in a seeded order, then a shuffle buffer."""
    import random

    rng = random.Random(str(seed))
    order = list(range(len(manifest["shards"])))
    rng.shuffle(order)
    return shuffled((s for i in order for s in iter_shard(stage_url, manifest["shards"][i])), buffer_size, rng)

"""A stage's output read while it is still being written (label.streaming follows generate).

Each process of the writing stage (a "part": a torchrun rank or a pod of `--num-shards N`; a lone process is part 0
of 1) records every shard the moment it is in storage, then its end, or its failure, under `<stage>/parts/stream/`:

    IIIII-KKKKK.json   shard K of part I: {config_hash, parts, shard}, `shard` being its manifest entry
    IIIII-end.json     part I ended after `shards` shards: {config_hash, parts, shards}
    IIIII-failed.json  part I failed: {config_hash, parts, error, time}

Reading part 0's shards, then part 1's, and so on is the order the stage's manifest lists them in, so a follower sees
the samples in the order a reader of the finished output does. Records of another config are ignored. Once the
manifest for the config is committed, the follower checks that what it read is the manifest's beginning and takes the
rest from the manifest, which ends the stream.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator

from rlaif.errors import UserError, one_line, redact
from rlaif.io import manifest, storage

FIRST_POLL_S, MAX_POLL_S = 0.2, 5.0  # idle polls back off to at most one round of reads per MAX_POLL_S
# A reader with nothing new says so after a minute, then every ten (the default timeout is an hour: a label launched
# with settings no generate is producing would otherwise wait silently)
NOTE_FIRST_S, NOTE_EVERY_S = 60.0, 600.0


def _record_name(part: int | str, name: str) -> str:
    """`part` is an index, or a glob pattern such as "*" (for records_matching)."""
    return f"{part:05d}-{name}.json" if isinstance(part, int) else f"{part}-{name}.json"


def record_url(stage_url: str, part: int, name: str) -> str:
    return storage.join(stage_url, "parts", "stream", _record_name(part, name))


def records_matching(stage_url: str, part: int | str, name: str) -> list[str]:
    """The records a pattern names (the stage's own URL taken literally)."""
    return storage.glob_under(storage.join(stage_url, "parts", "stream"), _record_name(part, name))


class PartRecorder:
    """The writing side for one part: pass `shard` as the ShardWriter's on_shard, then call `end` or `failed`."""

    def __init__(self, stage_url: str, part: int, parts: int, config_hash: str):
        self.stage_url, self.part, self.parts, self.config_hash = stage_url, part, parts, config_hash
        self.written = 0

    def _write(self, name: str, **fields) -> None:
        record = {"config_hash": self.config_hash, "parts": self.parts, **fields}
        storage.write_bytes_atomic(record_url(self.stage_url, self.part, name), json.dumps(record).encode())

    def shard(self, entry: dict) -> None:
        self._write(f"{self.written:05d}", shard=entry)
        self.written += 1

    def end(self) -> None:
        self._write("end", shards=self.written)

    def failed(self, exc: BaseException) -> None:
        text = one_line(exc, limit=None) or type(exc).__name__
        self._write("failed", error=redact(text)[:300], time=time.time())


def forget(stage_url: str, part: int | str) -> None:
    """A part starting over removes its records first, before any of its old shards go ("*": every part's)."""
    for url in records_matching(stage_url, part, "*"):
        storage.remove(url)


class Follower:
    """The shards of `stage_url`'s output for `config_hash`, yielded in manifest order as they land; `manifest` is
    set when the stream ends (the output committed). `reader` names the waiting stage and `timeout_setting` the
    setting that bounds a wait without news, for the errors."""

    def __init__(self, stage_url: str, config_hash: str, timeout_s: float, reader: str, timeout_setting: str):
        self.stage_url, self.config_hash, self.timeout_s = stage_url, config_hash, timeout_s
        self.reader, self.timeout_setting = reader, timeout_setting
        self.stage = stage_url.rstrip("/").rsplit("/", 1)[-1]
        self.since = time.time()  # failures recorded before this are an earlier attempt's, which a retry replaces
        self.manifest: dict | None = None

    def _read(self, part: int, name: str) -> dict | None:
        try:
            record = json.loads(storage.read_bytes(record_url(self.stage_url, part, name)))
        except FileNotFoundError:
            return None
        return record if record.get("config_hash") == self.config_hash else None

    def _committed(self) -> dict | None:
        committed = manifest.read(self.stage_url)
        return committed if committed and committed["config_hash"] == self.config_hash else None

    def _check_failures(self, reading: bool) -> None:
        for url in records_matching(self.stage_url, "*", "failed"):
            part = int(url.rsplit("/", 1)[1][:5])
            record = self._read(part, "failed")
            if record and record["time"] >= self.since:
                doing = "streaming its output" if reading else "waiting for its output"
                raise UserError(f"stage '{self.stage}' failed in part {part} ({record['error']}) while "
                                f"{self.reader} was {doing}: fix it and re-run both")

    def _rest(self, committed: dict, consumed: list[dict]) -> list[dict]:
        """The committed shards after the ones already read, which must be the manifest's first ones."""
        key = ("url", "count", "sha256")
        for got, listed in zip(consumed, committed["shards"]):
            if [got[k] for k in key] != [listed[k] for k in key]:
                raise UserError(f"stage '{self.stage}' committed other shards than the ones {self.reader} streamed "
                                f"({got['url']}): it was re-run meanwhile; re-run {self.reader}")
        if len(consumed) > len(committed["shards"]):
            raise UserError(f"stage '{self.stage}' committed fewer shards than {self.reader} streamed: it was re-run "
                            f"meanwhile; re-run {self.reader}")
        return committed["shards"][len(consumed):]

    def shards(self) -> Iterator[dict]:
        """Each shard as it lands, then the manifest's rest once it is committed (`manifest` set then)."""
        consumed = []
        for shard in self._landing(reading=True):
            consumed.append(shard)
            yield shard
        yield from self._rest(self.manifest, consumed)

    def wait(self) -> dict:
        """The committed manifest, waited for as long as shards keep landing (the shards themselves unread: a part
        that starts over meanwhile is no concern of a reader that read none)."""
        for _ in self._landing(reading=False):
            pass
        return self.manifest

    def _note_idle(self, idle_s: float, landed: int, notes: int, reading: bool) -> int:
        """Says on stdout (pod logs included) that nothing new has come for a while; returns the notes made."""
        if idle_s < NOTE_FIRST_S + notes * NOTE_EVERY_S:
            return notes
        limit = f"waiting up to {self.timeout_s:g}s ({self.timeout_setting})"
        if landed:
            shards = f"{landed} shard{'s' if landed > 1 else ''} of {self.stage}'s output"
            print(f"[{self.reader}] {shards} {'read' if reading else 'seen'}, none new for {idle_s:.0f}s; {limit}",
                  flush=True)
        else:
            print(f"[{self.reader}] no shard of {self.stage}'s output for these settings for {idle_s:.0f}s; {limit}: "
                  f"if no {self.stage} with these settings is running or starting, stop this and run it first",
                  flush=True)
        return notes + 1

    def _landing(self, reading: bool) -> Iterator[dict]:
        """The shard entries of this config's records, in manifest order, as they land; it ends once the output is
        committed, with `manifest` set. `reading`: the caller reads them (else it waits for the commit only)."""
        part, within, landed = 0, 0, 0
        idle_since, wait, notes = time.time(), FIRST_POLL_S, 0
        while True:
            storage.filesystem(self.stage_url).invalidate_cache()  # an s3:// listing cache would hide new records
            if committed := self._committed():
                self.manifest = committed
                return
            if record := self._read(part, f"{within:05d}"):
                within, landed = within + 1, landed + 1
                yield record["shard"]
                idle_since, wait, notes = time.time(), FIRST_POLL_S, 0  # the wait for the next one starts now
                continue
            end = self._read(part, "end")
            if end and end["shards"] == within and part + 1 < end["parts"]:
                part, within = part + 1, 0
                continue
            self._check_failures(reading)
            notes = self._note_idle(time.time() - idle_since, landed, notes, reading)
            if time.time() - idle_since > self.timeout_s:
                doing, so_far = ("streams", "read") if reading else ("waits for", "seen")
                raise UserError(f"{self.reader} {doing} stage '{self.stage}', which wrote no new shard for "
                                f"{self.timeout_s:g}s ({landed} {so_far} so far): check that '{self.stage}' is "
                                f"running (or run it), or raise {self.timeout_setting}")
            time.sleep(wait)
            wait = min(wait * 2, MAX_POLL_S)

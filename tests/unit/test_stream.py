"""Following a stage output while it is written (rlaif.io.stream): parts in manifest order whatever order they land
in, records of another config ignored, the committed manifest ends the stream and must begin with what was read, a
part's failure stops the reader, and silence ends in the timeout error."""
import re
import time

import pytest

from rlaif.errors import UserError
from rlaif.io import manifest, stream
from rlaif.io.stream import Follower, PartRecorder


def shard(name: str) -> dict:
    return {"url": f"shard-{name}.tar", "count": 1, "bytes": 10, "sha256": name}


def follower(url: str, timeout_s: float = 30.0) -> Follower:
    return Follower(url, "h", timeout_s, "label", "label.stream_timeout_s")


def commit(url: str, names: list[str]) -> None:
    manifest.write(url, stage="generate", run_id="r", config_hash="h", inputs={}, shards=[shard(n) for n in names])


def test_parts_are_read_in_manifest_order_and_the_manifest_ends_the_stream(tmp_path):
    url = f"file://{tmp_path}/generate"
    late = PartRecorder(url, 1, 2, "h")  # part 1 finishes first: it is still read after part 0
    late.shard(shard("100000"))
    late.end()
    PartRecorder(url, 0, 2, "another-config").shard(shard("stale"))
    with pytest.raises(UserError, match=r"wrote no new shard for 0.5s \(0 read so far\).*label.stream_timeout_s"):
        next(follower(url, timeout_s=0.5).shards())  # the other config's record is not part 0's first shard

    first = PartRecorder(url, 0, 2, "h")
    first.shard(shard("000000"))
    first.shard(shard("000001"))
    follow = follower(url)
    stream = follow.shards()
    assert [next(stream)["url"] for _ in range(2)] == ["shard-000000.tar", "shard-000001.tar"]
    first.end()  # part 0's end: only now part 1 comes next
    assert next(stream)["url"] == "shard-100000.tar"
    commit(url, ["000000", "000001", "100000", "100001"])  # a shard not recorded yet comes from the manifest
    assert [s["url"] for s in stream] == ["shard-100001.tar"]
    assert follow.manifest["num_samples"] == 4


def test_a_manifest_that_does_not_begin_with_what_was_read_is_refused(tmp_path):
    url = f"file://{tmp_path}/generate"
    PartRecorder(url, 0, 1, "h").shard(shard("000000"))
    stream = follower(url).shards()
    assert next(stream)["url"] == "shard-000000.tar"
    commit(url, ["000009"])
    with pytest.raises(UserError, match="committed other shards than the ones label streamed.*re-run label"):
        next(stream)


def test_a_failed_part_stops_the_reader_but_an_earlier_attempts_failure_does_not(tmp_path):
    url = f"file://{tmp_path}/generate"
    PartRecorder(url, 1, 2, "h").failed(RuntimeError("out of memory"))  # an earlier attempt: a retry replaces it
    time.sleep(0.01)
    with pytest.raises(UserError, match="wrote no new shard"):
        next(follower(url, timeout_s=0.5).shards())
    stream = follower(url).shards()
    PartRecorder(url, 1, 2, "h").failed(UserError("generate: every pair was dropped"))
    with pytest.raises(UserError, match=r"stage 'generate' failed in part 1 \(generate: every pair was dropped\)"):
        next(stream)


def test_a_reader_that_waits_says_it_waits_not_that_it_streams(tmp_path):
    url = f"file://{tmp_path}/generate"
    with pytest.raises(UserError, match=r"^label waits for stage 'generate', which wrote no new shard for 0.5s"):
        follower(url, timeout_s=0.5).wait()
    waiting = follower(url)
    PartRecorder(url, 0, 1, "h").failed(RuntimeError("out of memory"))
    with pytest.raises(UserError, match=r"failed in part 0 \(out of memory\) while label was waiting for its output"):
        waiting.wait()


def test_a_reader_with_nothing_to_read_says_so_in_its_log(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stream, "NOTE_FIRST_S", 0.2)
    monkeypatch.setattr(stream, "NOTE_EVERY_S", 0.3)
    url = f"file://{tmp_path}/generate"
    with pytest.raises(UserError, match="wrote no new shard for 0.9s"):
        next(follower(url, timeout_s=0.9).shards())
    notes = capsys.readouterr().out.splitlines()
    assert re.match(r"\[label\] no shard of generate's output for these settings for \d+s; waiting up to 0.9s "
                    r"\(label.stream_timeout_s\): if no generate with these settings is running or starting", notes[0])
    assert 1 <= len(notes) <= 3  # at 0.2s, then every 0.3s, as the polls (0.2s, doubling) come
    recorder = PartRecorder(url, 0, 1, "h")
    recorder.shard(shard("000000"))
    with pytest.raises(UserError, match=r"\(1 seen so far\)"):
        follower(url, timeout_s=0.5).wait()
    assert re.search(r"\[label\] 1 shard of generate's output seen, none new for \d+s; waiting up to 0.5s",
                     capsys.readouterr().out)

import hashlib
import json
import os

import pytest

from rlaif.config import DataConfig
from rlaif.errors import UserError
from rlaif.io import manifest, output_files, prompts, shards, storage


@pytest.fixture
def stage_dir(tmp_path):
    storage.configure(None)
    return storage.normalize(str(tmp_path / "stage"))


def _write(url, n, shard_size):
    with shards.ShardWriter(url, shard_size) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:04d}", "prompt.txt": f"prompt é {i}", "gen.json": {"i": i}})
    return manifest.write(url, stage="generate", run_id="r", config_hash="h", inputs={}, shards=w.shards)


def test_roundtrip_decodes_fields(stage_dir):
    m = _write(stage_dir, 7, 3)
    assert [s["count"] for s in m["shards"]] == [3, 3, 1] and m["num_samples"] == 7
    samples = shards.read_all(stage_dir, m)
    assert [s["__key__"] for s in samples] == [f"k{i:04d}" for i in range(7)]
    assert samples[5]["prompt.txt"] == "prompt é 5" and samples[5]["gen.json"] == {"i": 5}


@pytest.mark.parametrize("n,shard_size,world,workers",
                         [(10, 3, 2, 1), (10, 3, 2, 2), (10, 5, 3, 1), (10, 10, 2, 2), (9, 2, 1, 3)])
def test_split_over_ranks_and_workers_has_no_duplicates_or_losses(stage_dir, n, shard_size, world, workers):
    m = _write(stage_dir, n, shard_size)
    seen = [s["__key__"] for r in range(world) for w in range(workers)
            for s in shards.read_samples(stage_dir, m, r, world, w, workers)]
    assert sorted(seen) == [f"k{i:04d}" for i in range(n)]


def test_corrupted_shard_is_named(stage_dir):
    m = _write(stage_dir, 6, 3)
    path = storage.local_path(storage.join(stage_dir, "shard-000001.tar"))
    data = bytearray(path.read_bytes())
    data[700] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="shard-000001.tar"):
        shards.read_all(stage_dir, m)


def test_missing_shard_is_named(stage_dir):
    m = _write(stage_dir, 6, 3)
    os.remove(storage.local_path(storage.join(stage_dir, "shard-000000.tar")))
    with pytest.raises(UserError, match="shard-000000.tar.*missing"):
        shards.read_all(stage_dir, m)


def _damage_cases(url):
    """A committed output's files checked against its manifest: whole, truncated, deleted."""
    m = _write(url, 6, 3)
    assert manifest.damage(url, m) is None
    second = storage.join(url, "shard-000001.tar")
    data = storage.read_bytes(second)
    storage.write_bytes_atomic(second, data[: len(data) // 2])
    assert manifest.damage(url, m) == (f"shard-000001.tar has {len(data) // 2} bytes where its manifest says "
                                       f"{len(data)}")
    storage.remove(second)
    assert manifest.damage(url, m) == "shard-000001.tar is missing"


def test_damaged_output_is_found_by_size(stage_dir):
    _damage_cases(stage_dir)


def test_damaged_output_is_found_by_size_on_s3(s3_endpoint):
    endpoint, bucket = s3_endpoint
    storage.configure(endpoint)
    _damage_cases(f"s3://{bucket}/unit/damaged/generate")


def test_a_damaged_shard_names_the_stage_to_rerun(tmp_path):
    url = storage.normalize(str(tmp_path / "run" / "label"))
    m = _write(url, 4, 2)
    os.remove(storage.local_path(storage.join(url, "shard-000000.tar")))
    with pytest.raises(UserError, match=r"re-run stage 'label' \(rlaif run --rerun label, or rlaif launch label "):
        shards.read_all(url, m)


def test_manifest_digest_ignores_timestamps_and_invalidate_removes_output(stage_dir):
    m1 = _write(stage_dir, 4, 2)
    m2 = dict(m1, created_at="2000-01-01T00:00:00Z")
    assert manifest.digest(m1) == manifest.digest(m2) == m1["digest"]
    assert manifest.read(stage_dir)["digest"] == m1["digest"]
    manifest.invalidate(stage_dir)
    assert manifest.read(stage_dir) is None and storage.glob(storage.join(stage_dir, "shard-*.tar")) == []
    with pytest.raises(UserError, match="run stage 'generate' first"):
        manifest.require(stage_dir, "generate")


def test_prompt_split_is_stable_and_disjoint():
    data = DataConfig(prompts="data/prompts.jsonl", eval_fraction=0.1)
    train, held = prompts.split(data, "train"), prompts.split(data, "eval")
    assert not {p["id"] for p in train} & {p["id"] for p in held}
    assert len(train) + len(held) == len(prompts.load_prompts(data))
    assert 0.07 < len(held) / (len(train) + len(held)) < 0.13
    assert prompts.is_held_out("p00001", 0.1) == prompts.is_held_out("p00001", 0.1)


def test_join_keeps_the_scheme_whole():
    """A root at the filesystem's root (storage root / or file:///) joins to file:///run, not file:/run (a relative
    path that wrote into the working directory)."""
    assert storage.join(storage.normalize("/"), "run", "generate/") == "file:///run/generate"
    assert storage.join("file:///", "run") == "file:///run" and storage.join("s3://bucket/", "/run") == "s3://bucket/run"
    assert storage.join("/tmp/x/", "run") == "/tmp/x/run"


def test_a_repeated_prompt_text_stays_in_one_split(tmp_path):
    """A text given twice under other ids (or in other case and spacing) would train on held-out prompts if each id
    drew its own split: every copy follows its first row's."""
    texts = [f"Question number {i}?" for i in range(60)]
    rows = [{"id": f"p{i}a", "prompt": t} for i, t in enumerate(texts)]
    rows += [{"id": f"p{i}b", "prompt": f"  {t.upper()} "} for i, t in enumerate(texts)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(prompts=str(path), eval_fraction=0.3)
    train, held = prompts.split(data, "train"), prompts.split(data, "eval")
    def same(row):
        return " ".join(row["prompt"].split()).casefold()
    assert held and not {same(r) for r in train} & {same(r) for r in held}
    assert len(train) + len(held) == 120 and len(held) % 2 == 0
    # Without repeats the split is the ids' own, as before.
    assert [r["id"] for r in held if r["id"].endswith("a")] == [
        r["id"] for r in rows[:60] if prompts.is_held_out(r["id"], 0.3)]


@pytest.mark.parametrize("content,needle", [
    (b"", "holds no prompts"),
    (b"\xff\xfe bad", "not UTF-8"),
    (b'{"text": "no prompt field"}\n', "no string field 'prompt'"),
    (b"not json\n", "not valid JSON"),
    (b'{"prompt": "' + b"x" * 50 + b'"}\n', "exceeds data.max_prompt_chars"),
    (b'{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "line 2 has the prompt id 'a' of"),
    (b'{"prompt": "x", "keypoints": ["a"]}\n', "has a field 'keypoints' where 'key_points' is read"),
    (b'{"prompt": "x", "Key_Points": ["a"]}\n', "has a field 'Key_Points' where 'key_points' is read"),
    (b'{"prompt": "x", "refrence": "a"}\n', "has a field 'refrence' where 'reference' is read"),
])
def test_bad_prompt_files(tmp_path, content, needle):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=needle):
        prompts.load_prompts(DataConfig(prompts=str(path), max_prompt_chars=20))


def test_plain_text_prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\nsecond prompt\n")
    assert ([r["prompt"] for r in prompts.load_prompts(DataConfig(prompts=str(path)))]
            == ["first prompt", "second prompt"])


def test_unwritable_storage_root(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="not writable"):
        output_files.check_writable(storage.normalize(str(blocker / "runs")))


def test_checking_a_new_storage_root_creates_nothing(tmp_path):
    """A run refused by a later check (a missing prompts file) leaves no empty run directory behind."""
    output_files.check_writable(storage.normalize(str(tmp_path / "new" / "runs")))
    assert list(tmp_path.iterdir()) == []


def test_s3_roundtrip_through_moto(s3_endpoint):
    endpoint, bucket = s3_endpoint
    storage.configure(endpoint)
    url = f"s3://{bucket}/unit/stage"
    m = _write(url, 5, 2)
    assert [s["__key__"] for s in shards.read_all(url, m)] == [f"k{i:04d}" for i in range(5)]
    assert json.loads(storage.read_text(storage.join(url, "manifest.json")))["digest"] == m["digest"]
    # webdataset itself can open s3:// URLs through the registered handler
    import webdataset as wds

    keys = [s["__key__"] for s in wds.WebDataset(storage.join(url, "shard-000000.tar"), shardshuffle=False)]
    assert keys == ["k0000", "k0001"]


@pytest.mark.parametrize("name, sibling", [("runs*", "runsA"), ("exp[1]", "exp1"), ("q?", "qx")])
def test_a_local_root_named_like_a_pattern_is_taken_literally(tmp_path, name, sibling):
    """Wildcards in a local root's name ('runs*', a checkout in 'exp[1]'): removing a stage's outputs there globbed
    them, and took the sibling run's shards and stream records for its own."""
    from rlaif.io import stream

    stages = {}
    for root in (name, sibling):
        url = storage.normalize(str(tmp_path / root / "r" / "generate"))
        _write(url, 5, 2)
        stream.PartRecorder(url, 0, 1, "hash").shard({"url": "shard-000000.tar"})
        stages[root] = url
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / sibling).rglob("*"))
    manifest.invalidate(stages[name])
    stream.forget(stages[name], "*")
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / sibling).rglob("*")) == before
    assert storage.glob_under(stages[name], "shard-*.tar") == []
    assert storage.glob_under(stages[sibling], "shard-*.tar") == [f"{stages[sibling]}/shard-00000{i}.tar"
                                                                   for i in range(3)]


def test_a_model_directory_that_fails_its_checksum_leaves_no_copy_in_the_cache(s3_endpoint, tmp_path, monkeypatch):
    """A damaged download is refused, and its copy goes: every retry of a pod left another whole model behind."""
    endpoint, bucket = s3_endpoint
    storage.configure(endpoint)
    monkeypatch.setenv("RLAIF_CACHE", str(tmp_path / "cache"))
    url = f"s3://{bucket}/unit/damaged-model[1]"  # listed, not globbed: '[' is part of the name
    storage.write_bytes_atomic(storage.join(url, "weights.bin"), b"damaged")
    storage.write_bytes_atomic(storage.join(url, "sub", "config.json"), b"{}")
    assert storage.list_files(url) == ["sub/config.json", "weights.bin"]
    with pytest.raises(UserError, match="weights.bin does not match its manifest checksum"):
        storage.download_dir(url, [{"path": "weights.bin", "sha256": "0" * 64}])
    assert list((tmp_path / "cache").iterdir()) == []
    copy = storage.download_dir(url, [{"path": "weights.bin", "sha256": hashlib.sha256(b"damaged").hexdigest()}])
    assert (copy / "weights.bin").read_bytes() == b"damaged"


def test_shuffle_buffer_is_a_seeded_permutation():
    import random

    items = [{"i": i} for i in range(100)]
    a = [x["i"] for x in shards.shuffled(iter(items), 10, random.Random(1))]
    b = [x["i"] for x in shards.shuffled(iter(items), 10, random.Random(1))]
    c = [x["i"] for x in shards.shuffled(iter(items), 10, random.Random(2))]
    assert sorted(a) == list(range(100)) and a == b and a != c and a != list(range(100))
    # a buffer of 10 emits its first item after reading 10: item i cannot come out before position i - 9
    assert all(pos >= i - 9 for pos, i in enumerate(a))
    assert a.index(99) >= 90


def test_shuffled_stream_reads_every_sample_once_in_seeded_order(stage_dir):
    m = _write(stage_dir, 23, 4)
    one = [s["__key__"] for s in shards.shuffled_stream(stage_dir, m, (0, 0), 8)]
    again = [s["__key__"] for s in shards.shuffled_stream(stage_dir, m, (0, 0), 8)]
    other_epoch = [s["__key__"] for s in shards.shuffled_stream(stage_dir, m, (0, 1), 8)]
    assert sorted(one) == [f"k{i:04d}" for i in range(23)] and one == again and one != other_epoch


def test_identical_samples_give_identical_digests(tmp_path):
    storage.configure(None)
    a = _write(storage.normalize(str(tmp_path / "a")), 9, 4)
    b = _write(storage.normalize(str(tmp_path / "b")), 9, 4)
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]] and a["digest"] == b["digest"]


def test_s3_calls_are_bounded_and_their_failures_are_one_line(monkeypatch):
    """An endpoint that accepts connections and never answers held a run silent for over 6 minutes (s3fs's 5 tries
    of botocore's 5 legacy attempts); a botocore error mid-stage was a traceback."""
    from botocore.exceptions import EndpointConnectionError

    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "")  # configure exports the endpoint: restored after the test
    storage.configure("http://127.0.0.1:9")
    fs = storage.filesystem("s3://bucket/key")
    assert fs.config_kwargs["retries"] == {"total_max_attempts": 2, "mode": "standard"}
    from botocore.config import Config  # what botocore makes of it: 2 attempts in all, not 2 retries

    assert Config(**fs.config_kwargs).retries["total_max_attempts"] == 2
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    storage.configure("http://127.0.0.1:9")
    assert storage.filesystem("s3://bucket/key").config_kwargs["retries"]["total_max_attempts"] == 7
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "many")
    with pytest.raises(UserError, match="AWS_MAX_ATTEMPTS='many'"):
        storage.configure("http://127.0.0.1:9")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    storage.configure(None)
    try:
        try:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9/bucket/key")
        except EndpointConnectionError as exc:
            raise RuntimeError("a shard could not be read") from exc
    except RuntimeError as wrapped:
        message = storage.failure_message(wrapped)
    assert message.startswith("object storage failed (Could not connect to the endpoint URL") and "\n" not in message
    assert storage.failure_message(ValueError("not storage")) is None
    from botocore.exceptions import ClientError

    missing = ClientError({"Error": {"Code": "NoSuchKey", "Message": "no such key"}}, "GetObject")
    assert storage.failure_message(missing) is None  # a missing object is the caller's to name
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"}}, "PutObject")
    assert storage.failure_message(denied).startswith("object storage failed (An error occurred (AccessDenied)")


def test_a_put_to_an_endpoint_that_never_answers_fails_instead_of_hanging(monkeypatch):
    """botocore sent PUTs with Expect: 100-continue, whose answer aiohttp awaits with no timeout: `rlaif run` against
    such an endpoint hung at its first write (the probe killed it after 400 s)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted = []
    threading.Thread(target=lambda: [accepted.append(server.accept()) for _ in range(16)], daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    storage.configure(f"http://127.0.0.1:{server.getsockname()[1]}")
    storage._s3_options["config_kwargs"]["read_timeout"] = 1  # s3fs's 15 s, shortened for the test
    outcome = []

    def put():
        try:
            storage.write_bytes_atomic("s3://bucket/never-answered", b"x")
        except Exception as exc:  # noqa: BLE001 - the test wants whatever ends the write
            outcome.append(exc)

    writer = threading.Thread(target=put, daemon=True)
    writer.start()
    writer.join(90)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    storage.configure(None)
    server.close()
    assert not writer.is_alive(), "the put hung"
    assert outcome and storage.failure_message(outcome[0]) is not None


def test_non_finite_numbers_are_written_as_null_in_strict_json(tmp_path):
    """One held-out prompt made evaluate's reward std NaN, written as a bare NaN that strict JSON parsers refuse."""
    url = f"file://{tmp_path}/evaluate"
    written = manifest.write(url, stage="evaluate", run_id="r", config_hash="h", inputs={},
                             summary={"std": float("nan"), "ratio": [1.0, float("inf")], "ok": 0.5})

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    stored = json.loads((tmp_path / "evaluate" / "manifest.json").read_text(), parse_constant=refuse)
    assert stored["summary"] == {"std": None, "ratio": [1.0, None], "ok": 0.5} == written["summary"]
    assert manifest.damage(url, manifest.read(url)) is None  # the digest is over what was written


def test_file_localhost_is_the_local_root(tmp_path, monkeypatch):
    """file://localhost/tmp/x (RFC 8089's explicit local host) became ./localhost/tmp/x under the working directory."""
    monkeypatch.chdir(tmp_path)
    assert storage.normalize("file://localhost/srv/runs") == "file:///srv/runs"
    assert storage.normalize("file://runs/x") == f"file://{tmp_path}/runs/x"  # a relative path, as documented

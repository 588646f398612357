"""Streaming label (label.streaming) on the tiny policy: label labels generate's shards while generate is still
writing them, split in parts or in one process, and commits the manifest a sequential run commits (same digest);
a generate that fails stops it with one clear error and no manifest; `rlaif run`'s runner starts the two together
and, when generate dies without a trace, stops label instead of leaving it waiting."""
import threading
import time
from pathlib import Path

import pytest

from rlaif import runner
from rlaif.config import load_config
from rlaif.errors import StageFailed, UserError
from rlaif.io import manifest, stream
from rlaif.orchestration import launch
from rlaif.runner import run_stage
from rlaif.stages import generate
from rlaif.stages import label as label_stage

REPO = Path(__file__).resolve().parents[2]
ONE_PROCESS = ("generate.shard_size=4", "generate.batch_size=8")  # 8 shards: label can start on the first


def tiny(root, *overrides):
    return load_config(str(REPO / "configs/tiny.yaml"), [f"storage.root=file://{root}", "label.judge=rules",
                                                         "label.batch_size=5", "label.shard_size=7", *overrides])


def stage_manifest(cfg, name: str) -> dict | None:
    return manifest.read(f"{cfg.storage.root}/{cfg.run_id}/{name}")


def wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"gave up waiting: {what}"
        time.sleep(0.05)


class StreamingLabel:
    """label run in a thread with streaming on, recording which shards of generate it opened, in order."""

    def __init__(self, cfg, monkeypatch):
        self.opened: list[str] = []
        self.error: BaseException | None = None
        read = label_stage.iter_shard

        def spy(url, shard):
            self.opened.append(shard["url"])
            yield from read(url, shard)

        monkeypatch.setattr(label_stage, "iter_shard", spy)
        self.thread = threading.Thread(target=self._run, args=(cfg,), daemon=True)
        self.thread.start()

    def _run(self, cfg):
        try:
            run_stage(cfg, "label")
        except BaseException as exc:  # raised again in the test's thread by `result`
            self.error = exc

    def result(self) -> None:
        self.thread.join(timeout=300)
        assert not self.thread.is_alive(), "label still running"
        if self.error:
            raise self.error


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    """generate then label, one after the other: in 3 parts, and in one process."""
    parts = tiny(tmp_path_factory.mktemp("parts"))
    for index in range(3):
        run_stage(parts, "generate", index, 3)
    run_stage(parts, "label")
    single = tiny(tmp_path_factory.mktemp("single"), *ONE_PROCESS)
    run_stage(single, "generate")
    run_stage(single, "label")
    return {name: (stage_manifest(cfg, "generate"), stage_manifest(cfg, "label"))
            for name, cfg in (("parts", parts), ("single", single))}


def test_label_streams_parts_as_they_land_and_matches_the_sequential_digest(tmp_path, monkeypatch, sequential):
    cfg = tiny(tmp_path, "label.streaming=true")
    label = StreamingLabel(cfg, monkeypatch)
    run_stage(cfg, "generate", 0, 3)
    wait_until(lambda: label.opened, "label opening part 0's first shard")  # parts 1 and 2 do not exist yet
    assert label.opened[0] == "shard-000000.tar" and not stage_manifest(cfg, "label")
    run_stage(cfg, "generate", 1, 3)
    run_stage(cfg, "generate", 2, 3)
    label.result()
    gen, lab = sequential["parts"]
    assert stage_manifest(cfg, "generate")["digest"] == gen["digest"]
    assert label.opened == [s["url"] for s in gen["shards"]]  # each shard once, in the manifest's order
    assert stage_manifest(cfg, "label")["digest"] == lab["digest"]  # same labels, shards, inputs and cache key


def first_shard_waits_for(label: StreamingLabel, monkeypatch) -> None:
    """generate goes on after its first shard only once label has opened it."""
    record = stream.PartRecorder.shard

    def shard(recorder, entry):
        record(recorder, entry)
        if recorder.written == 1:
            wait_until(lambda: label.opened, "label opening generate's first shard")

    monkeypatch.setattr(stream.PartRecorder, "shard", shard)


def test_a_one_process_generate_streams_too(tmp_path, monkeypatch, sequential):
    cfg = tiny(tmp_path, "label.streaming=true", *ONE_PROCESS)
    label = StreamingLabel(cfg, monkeypatch)
    first_shard_waits_for(label, monkeypatch)
    run_stage(cfg, "generate")
    label.result()
    gen, lab = sequential["single"]
    assert len(gen["shards"]) == 8 and label.opened == [s["url"] for s in gen["shards"]]
    assert stage_manifest(cfg, "generate")["digest"] == gen["digest"]
    assert stage_manifest(cfg, "label")["digest"] == lab["digest"]


def test_a_failing_generate_stops_the_streaming_label(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, "label.streaming=true", *ONE_PROCESS)
    label = StreamingLabel(cfg, monkeypatch)
    first_shard_waits_for(label, monkeypatch)
    sample = generate.TransformersBackend.sample

    def out_of_memory_once_label_follows(backend, texts, seeds):  # generate dies mid-way, after its first shard
        if label.opened:
            raise RuntimeError("CUDA out of memory")
        return sample(backend, texts, seeds)

    monkeypatch.setattr(generate.TransformersBackend, "sample", out_of_memory_once_label_follows)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        run_stage(cfg, "generate")
    with pytest.raises(UserError, match=r"stage 'generate' failed in part 0 \(CUDA out of memory\) while label was "
                                        r"streaming its output: fix it and re-run both"):
        label.result()
    assert stage_manifest(cfg, "label") is None and stage_manifest(cfg, "generate") is None


def test_a_streaming_label_without_a_generate_times_out(tmp_path):
    cfg = tiny(tmp_path, "label.streaming=true", "label.stream_timeout_s=0.5")
    with pytest.raises(UserError, match=r"label streams stage 'generate', which wrote no new shard for 0.5s "
                                        r"\(0 read so far\): check that 'generate' is running \(or run it\), or raise "
                                        r"label.stream_timeout_s"):
        run_stage(cfg, "label")
    assert stage_manifest(cfg, "label") is None


def test_the_runner_starts_generate_and_label_together(tmp_path, capfd, sequential):
    cfg = tiny(tmp_path, "label.streaming=true", *ONE_PROCESS)
    assert runner.launch_groups(cfg) == [["generate", "label"], ["train_rm"], ["ppo"], ["evaluate"]]
    assert runner.launch_groups(tiny(tmp_path)) == [[s] for s in ("generate", "label", "train_rm", "ppo", "evaluate")]
    runner.launch_together(["generate", "label"], launch.prepare(cfg))
    # label's launch found generate's output not there yet, and streamed it
    assert "[label] streaming: reads generate's output as it is written" in capfd.readouterr().out
    assert stage_manifest(cfg, "label")["digest"] == sequential["single"][1]["digest"]


def test_a_damaged_generate_runs_again_before_label_streams_it(tmp_path, capfd, sequential):
    """The runner drops the damaged output's manifest before starting the pair: label streams the new shards, not the
    truncated one (nor shards being replaced), and commits the sequential run's labels."""
    cfg = tiny(tmp_path, "label.streaming=true", *ONE_PROCESS)
    config_url = launch.prepare(cfg)
    runner.run_group(cfg, ["generate", "label"], config_url)
    labelled = stage_manifest(cfg, "label")
    shard = tmp_path / "tiny/generate/shard-000000.tar"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    capfd.readouterr()
    runner.run_group(cfg, ["generate", "label"], config_url)
    out = capfd.readouterr().out
    assert out.count("its output for this config is damaged") == 1 and "[label] streaming: reads" not in out
    assert shard.stat().st_size == size
    # label's output for these settings was there: it waited for the new generate output, which came out as before
    assert "[label] its output for these settings exists: waiting for generate's output" in out, out
    assert "[label] cache hit" in out and stage_manifest(cfg, "label") == labelled


def test_a_rerun_generate_that_comes_out_the_same_leaves_the_streamed_label_cached(tmp_path, capfd, sequential):
    """`--rerun generate` with streaming: label waits for generate instead of replacing its output while it cannot
    know whether generate comes out the same (it re-labelled every pair before); with another label setting it
    streams again."""
    cfg = tiny(tmp_path, "label.streaming=true", *ONE_PROCESS)
    runner.run_group(cfg, ["generate", "label"], launch.prepare(cfg))
    labelled = stage_manifest(cfg, "label")
    capfd.readouterr()
    runner.run_group(cfg, ["generate", "label"], launch.prepare(cfg), rerun={"generate"})
    out = capfd.readouterr().out
    assert "[label] cache hit" in out and stage_manifest(cfg, "label") == labelled, out
    # it streams where its output cannot hold: label's settings changed, generate's (its digest then changes too),
    # or label runs again anyway
    for overrides, rerun in ((["label.min_confidence=0.01"], {"generate"}), (["generate.max_prompts=24"], set()),
                             ([], {"generate", "label"})):
        other = tiny(tmp_path, "label.streaming=true", *overrides, *ONE_PROCESS)
        runner.run_group(other, ["generate", "label"], launch.prepare(other), rerun=rerun)
        out = capfd.readouterr().out
        assert "[label] streaming: reads" in out and "waiting for generate's output" not in out, (overrides, out)


def test_a_stream_that_never_comes_leaves_the_previous_output(tmp_path, sequential):
    """A streaming label launched with other settings than generate's output was made with (and no generate running)
    times out without having removed the label output there (it emptied label's directory, then waited)."""
    cfg = tiny(tmp_path, *ONE_PROCESS)
    run_stage(cfg, "generate")
    run_stage(cfg, "label")
    labelled = stage_manifest(cfg, "label")
    files = sorted(p.name for p in (tmp_path / "tiny/label").iterdir())
    for changed in (["generate.max_new_tokens=9", "label.min_confidence=0.01"], ["generate.max_new_tokens=9"]):
        other = tiny(tmp_path, *ONE_PROCESS, *changed, "label.streaming=true", "label.stream_timeout_s=0.5")
        with pytest.raises(UserError, match="wrote no new shard for 0.5s"):
            run_stage(other, "label")
        assert stage_manifest(cfg, "label") == labelled
        assert sorted(p.name for p in (tmp_path / "tiny/label").iterdir()) == files


def test_the_runner_stops_label_when_generate_dies_without_a_trace(tmp_path, monkeypatch, capfd):
    cfg = tiny(tmp_path, "label.streaming=true", "label.stream_timeout_s=600", *ONE_PROCESS)
    monkeypatch.setenv("RLAIF_FAULT", "generate:2:0")  # SIGKILL after generate's second batch: no failure record
    # the launcher's own line, once (the runner added "failed with exit code 1" below it), naming what SIGKILL means
    with pytest.raises(StageFailed, match=r"^stage 'generate' was killed by SIGKILL \(a kill -9, a pre-empted node or "
                                          r"the out-of-memory killer; its output is above\)$"):
        runner.launch_together(["generate", "label"], launch.prepare(cfg))
    err = capfd.readouterr().err
    assert "interrupted" not in err and "killed by" not in err  # label's launcher and stage said nothing either
    assert stage_manifest(cfg, "label") is None
    assert not (tmp_path / "tiny/label/.lock").exists()  # label was interrupted and let its lock go

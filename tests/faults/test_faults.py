"""Faults as real processes: a second runner on a running run refuses (stage lock in storage), a kill -9 of the
runner during PPO takes its torchrun agent and ranks down with it and leaves a stale lock that the re-run takes over,
resuming PPO from its last checkpoint, a SIGTERM stops a launcher's stage and releases its lock, a stage
killed mid-output leaves shards that nothing downstream reads, a shard corrupted on disk is caught by its
checksum and named, and a rank that stops alone with a user error is reported in its one line, without its peer's
traceback."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_output import failure

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def rlaif(*args, env=None, timeout=900):
    return subprocess.run([sys.executable, "-m", "rlaif", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def one_error_line(proc) -> str:
    assert proc.returncode == 2, failure(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, failure(proc)
    return errors[0]


def processes_under(path: Path) -> list[str]:
    """Command lines of running processes that name `path` (a run's stage processes all carry its storage root)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmdline and str(os.getpid()) != proc.name:
            found.append(cmdline)
    return found


def no_processes_under(path: Path, within_s: float = 60.0) -> bool:
    deadline = time.time() + within_s
    while processes_under(path) and time.time() < deadline:
        time.sleep(0.5)
    return not processes_under(path)


def test_second_runner_refuses_and_a_killed_runner_resumes_from_the_ppo_checkpoint(tmp_path):
    root = f"file://{tmp_path}"
    args = ("run", "--config", "configs/tiny.yaml", "--storage-root", root, "--set", "ppo.iterations=20",
            "--set", "ppo.checkpoint_every=5")  # a PPO long enough to be caught mid-run, checkpointing often
    first = subprocess.Popen([sys.executable, "-m", "rlaif", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    lock_file, checkpoint = tmp_path / "tiny/ppo/.lock", tmp_path / "tiny/ppo/checkpoints/latest.json"
    deadline = time.time() + 300

    def wait_for(path: Path, what: str, proc: subprocess.Popen = first) -> None:
        while not path.exists():
            assert proc.poll() is None and time.time() < deadline, f"the process ended before {what}"
            time.sleep(0.2)

    wait_for(lock_file, "ppo")  # well into the run: generate, label and train_rm are done
    assert json.loads(lock_file.read_text())["pid"] == first.pid

    second = rlaif(*args)  # refused up front: `rlaif run` holds the run from before it writes config.yaml
    assert f"run 'tiny' is already running (pid {first.pid} on " in one_error_line(second)
    assert "cache hit" not in second.stdout

    wait_for(checkpoint, "a PPO checkpoint")
    os.kill(first.pid, signal.SIGKILL)  # the runner alone (OOM killer): its torchrun agent and ranks follow it
    first.wait()
    assert no_processes_under(tmp_path), processes_under(tmp_path)
    assert lock_file.exists() and not (tmp_path / "tiny/ppo/manifest.json").exists()
    step = json.loads(checkpoint.read_text())["step"]

    canary = "sk-canary-7f3a9c1e5b2d4f6a8c0e"  # secrets in the environment never reach an output or a log line
    resumed = rlaif(*args, env={"OPENAI_API_KEY": canary, "AWS_SECRET_ACCESS_KEY": canary, "HF_TOKEN": canary})
    assert resumed.returncode == 0, failure(resumed)
    assert all(f"[{s}] cache hit" in resumed.stdout for s in ("generate", "label", "train_rm"))
    assert "[ppo] running" in resumed.stdout and "[evaluate] running" in resumed.stdout and "report: " in resumed.stdout
    assert f"resumed from checkpoint step-{step:08d}" in resumed.stdout + resumed.stderr
    assert not list(tmp_path.rglob(".lock"))  # released at the end of each stage
    assert canary not in resumed.stdout + resumed.stderr
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert canary.encode() not in path.read_bytes(), path

    # SIGTERM (a pod deleted, a task stopped) to a launcher mid-PPO: its stage stops and its lock is released.
    manifest_before = (tmp_path / "tiny/ppo/manifest.json").read_bytes()
    launcher = subprocess.Popen([sys.executable, "-m", "rlaif", "launch", "ppo", *args[1:], "--set", "ppo.lr=2e-5"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    wait_for(lock_file, "the relaunched ppo", launcher)
    time.sleep(3)
    launcher.terminate()
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 143 and err.strip().endswith("terminated"), err[-2000:]
    assert err.count("terminated") == 1, err[-2000:]  # said by the launcher, not again by the stage and its ranks
    assert no_processes_under(tmp_path), processes_under(tmp_path)
    # The new config's stage may already have invalidated the old manifest (a stage re-run for another config removes
    # its old output first); what it must not do is commit one of its own.
    committed = tmp_path / "tiny/ppo/manifest.json"
    assert not lock_file.exists() and (not committed.exists() or committed.read_bytes() == manifest_before)


RULES_RUN = ["--config", "configs/tiny.yaml", "--set", "label.judge=rules", "--set", "ppo.iterations=1",
             "--set", "tracking.report_to=[tensorboard]", "--set", "train_rm.checkpoint_every=1"]
RULES_STAGES = ("generate", "label", "train_rm", "ppo")


@pytest.fixture(scope="module")
def rules_run(tmp_path_factory) -> Path:
    """generate, label (rules judge), train_rm (a checkpoint every step) and ppo, run once for the tests that re-run
    them: each copies the run (`tiny`) into its own storage root."""
    root = tmp_path_factory.mktemp("rules-run")
    for stage in RULES_STAGES:
        proc = rlaif("launch", stage, *RULES_RUN, "--storage-root", f"file://{root}")
        assert proc.returncode == 0, failure(proc)
    return root / "tiny"


def copied_run(run: Path, tmp_path: Path) -> str:
    shutil.copytree(run, tmp_path / "tiny")
    return f"file://{tmp_path}"


def digests(run: Path) -> list[str]:
    return [json.loads((run / f"{stage}/manifest.json").read_text())["digest"] for stage in RULES_STAGES]


def test_rerunning_a_stage_gives_the_same_digest(rules_run, tmp_path):
    # Digests cover what a stage made, not its records: train_rm and ppo also write per-step throughput, TensorBoard
    # event files and model cards naming the run, which differ on every re-run.
    root = copied_run(rules_run, tmp_path)
    for stage in RULES_STAGES:  # real re-runs, not cache hits
        (tmp_path / f"tiny/{stage}/manifest.json").unlink()
    for stage in RULES_STAGES:
        proc = rlaif("launch", stage, *RULES_RUN, "--storage-root", root)
        assert proc.returncode == 0 and "cache hit" not in proc.stdout, failure(proc)
    assert list((tmp_path / "tiny/train_rm").glob("tensorboard/*"))  # the records were written, and differ
    assert digests(tmp_path / "tiny") == digests(rules_run)


def test_train_rm_resumed_from_its_last_checkpoint_makes_the_same_output(rules_run, tmp_path):
    """Killed after its last step's checkpoint, train_rm resumes with no step left to train: it wrote the tokenizer
    with the padding and truncation of the package's file instead of its last batch's (another digest, so ppo and
    evaluate ran again) and lost its metrics."""
    root = copied_run(rules_run, tmp_path)
    stage_dir = tmp_path / "tiny/train_rm"
    uninterrupted = json.loads((stage_dir / "manifest.json").read_text())["digest"]
    metrics = (stage_dir / "metrics.jsonl").read_text().splitlines()
    last_step = json.loads(metrics[-1])["step"]
    shutil.rmtree(stage_dir)
    killed = rlaif("launch", "train_rm", *RULES_RUN, "--storage-root", root,
                   env={"RLAIF_FAULT": f"train_rm:{last_step}:0"})
    assert killed.returncode != 0 and not (stage_dir / "manifest.json").exists()
    assert "error: stage 'train_rm' rank 0 was killed by SIGKILL (a kill -9" in killed.stderr  # not torchrun's 1
    assert "ChildFailedError" not in killed.stderr  # torchrun's own report: the line says what it says
    resumed = rlaif("launch", "train_rm", *RULES_RUN, "--storage-root", root)
    assert resumed.returncode == 0 and f"(step {last_step})" in resumed.stdout, resumed.stdout[-2000:]
    assert json.loads((stage_dir / "manifest.json").read_text())["digest"] == uninterrupted
    assert [json.loads(line)["step"] for line in (stage_dir / "metrics.jsonl").read_text().splitlines()] == [
        json.loads(line)["step"] for line in metrics]


def test_a_stage_killed_mid_output_is_never_read(tmp_path):
    root = f"file://{tmp_path}"
    killed = rlaif("launch", "generate", "--config", "configs/tiny.yaml", "--storage-root", root,
                   env={"RLAIF_FAULT": "generate:2:0"})
    assert killed.returncode != 0
    stage = tmp_path / "tiny/generate"
    assert list(stage.glob("shard-*.tar")) and not (stage / "manifest.json").exists()  # shards, no commit
    label = rlaif("launch", "label", "--config", "configs/tiny.yaml", "--storage-root", root)
    assert "run stage 'generate' first" in one_error_line(label)
    assert not (tmp_path / "tiny/label/manifest.json").exists()


def test_a_corrupted_shard_is_caught_by_its_checksum(tmp_path):
    root = f"file://{tmp_path}"
    assert rlaif("launch", "generate", "--config", "configs/tiny.yaml", "--storage-root", root).returncode == 0
    shard = tmp_path / "tiny/generate/shard-000001.tar"
    data = bytearray(shard.read_bytes())
    at = data.index(b"response_a.txt") + 600  # inside the first sample's text, past its tar header
    data[at] = (data[at] + 1) % 256
    shard.write_bytes(bytes(data))
    label = rlaif("launch", "label", "--config", "configs/tiny.yaml", "--storage-root", root, "--set",
                  "label.judge=rules")
    line = one_error_line(label)
    assert "shard-000001.tar" in line and ("checksum" in line or "malformed" in line)
    assert not (tmp_path / "tiny/label/manifest.json").exists()


def start_moto(port: int) -> subprocess.Popen:
    import shutil
    import socket

    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            assert time.time() < deadline and proc.poll() is None, "moto_server did not start"
            time.sleep(0.1)


def test_s3_endpoint_lost_during_shard_uploads_then_back(tmp_path, monkeypatch):
    import socket

    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    args = ("launch", "generate", "--config", "configs/tiny.yaml", "--storage-root", "s3://faults/runs",
            "--set", f"storage.endpoint_url={endpoint}", "--set", "generate.shard_size=1",
            "--set", "generate.batch_size=2")
    moto = start_moto(port)
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket="faults")
    stage = subprocess.Popen([sys.executable, "-m", "rlaif", *args], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not s3.list_objects_v2(Bucket="faults", Prefix="runs/tiny/generate/shard-").get("KeyCount"):
            assert stage.poll() is None and time.time() < deadline, "generate ended before its first upload"
            time.sleep(0.05)
        moto.kill()  # the endpoint goes away between two shard uploads
        moto.wait()
        out, err = stage.communicate(timeout=600)
        assert stage.returncode != 0, out[-2000:]
        # one line, not botocore's traceback (not committed: nothing downstream would read its shards)
        assert "error: object storage failed" in err and "Traceback" not in err and stage.returncode == 2, err[-3000:]
        moto = start_moto(port)  # back, empty (moto keeps no state): the re-run writes everything again
        s3.create_bucket(Bucket="faults")
        again = rlaif(*args)
        assert again.returncode == 0, failure(again)
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="faults", Prefix="runs/tiny/generate/")["Contents"]}
        assert "runs/tiny/generate/manifest.json" in keys and len([k for k in keys if "/shard-" in k]) == 32
    finally:
        stage.kill()
        moto.kill()


ONE_RANK_FAILS = """
import sys
import torch
import torch.distributed as dist
from rlaif import cli
from rlaif.errors import UserError

def command(args):
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise UserError("rank 1 read a bad row: fix it")
    dist.all_reduce(torch.zeros(1))  # rank 0 waits here for the peer that left
    return 0

cli.COMMANDS["graph"] = command
sys.exit(cli.main(["graph"]))
"""


def test_a_rank_that_fails_alone_is_reported_without_its_peers_traceback(tmp_path, capfd):
    from rlaif.orchestration import launch

    script = tmp_path / "one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS)
    error_file = tmp_path / "stage.err"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    code, agent_report = launch.run_relaying_stderr(cmd, dict(os.environ, OMP_NUM_THREADS="1",
                                                              RLAIF_ERROR_FILE=str(error_file)))
    relayed = capfd.readouterr().err
    assert code != 0
    assert error_file.read_text().splitlines() == ["rank 1 read a bad row: fix it"]
    assert "Traceback" not in relayed and "Connection closed" not in relayed, relayed
    assert b"ChildFailedError" in agent_report  # torchrun's own report is held back for the launcher to drop


LATE_COLLECTIVE = """
import time
import torch
import torch.distributed as dist
from rlaif import distributed

dist.init_process_group("gloo")
world_group = dist.group.WORLD  # held elsewhere, as a DeepSpeed engine holds its groups: it outlives teardown
if dist.get_rank() == 1:
    time.sleep(1)  # rank 0 reaches teardown first, with its half of the gather still in flight
outputs = [torch.empty(1000) for _ in range(2)]
dist.all_gather(outputs, torch.ones(1000), async_op=True)  # the handle dropped, as a prefetch nobody waited for
del outputs
distributed.teardown()
"""


def test_a_collective_still_in_flight_at_teardown_does_not_abort_the_rank_at_exit(tmp_path):
    # Without the barrier in teardown, the gloo thread that finishes the gather frees its tensors while the
    # interpreter shuts down, and rank 0 aborts after its work is done: seen in 2 of 3 launches, so three here.
    script = tmp_path / "late_collective.py"
    script.write_text(LATE_COLLECTIVE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    for _ in range(3):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, failure(proc)

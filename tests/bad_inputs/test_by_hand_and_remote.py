"""Classes a sixth probe found: a stage started by hand (`rlaif stage`) beside a launcher of the same stage, or with
another process count than its config keys; a large data file edited in place keeping its size and mtime; an http(s)
input whose server accepts and never answers; argparse's errors over several lines; W&B without a key found only at
train_rm; a full disk not saying which output it was writing. Each: exit 2 and one line, a cache miss, or a bounded
wait."""
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlaif import runner
from rlaif.cli import main
from rlaif.config import DataConfig, load_config
from rlaif.errors import UserError
from rlaif.io import digest, storage
from rlaif.io.lock import StageLock
from rlaif.io.prompt_sources import source_digest
from rlaif.io.prompts import load_prompts
from rlaif.stages.common import stage_url

TINY = "configs/tiny.yaml"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def by_hand(monkeypatch):
    """As a user starts `rlaif stage`: not from a launcher (which holds the lock and sets RLAIF_CACHE_CHECKED), on a
    machine without GPUs."""
    from rlaif.orchestration import preflight

    monkeypatch.delenv("RLAIF_CACHE_CHECKED", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(preflight, "gpu_count", lambda: 0)


def test_a_stage_started_by_hand_waits_for_no_one_and_writes_beside_no_one(tmp_path, capsys, monkeypatch):
    cfg = load_config(TINY, [f"storage.root=file://{tmp_path}", "run_id=busy"])
    argv = ["stage", "generate", "--config", TINY, "--set", f"storage.root=file://{tmp_path}", "--set", "run_id=busy"]
    generate = tmp_path / "busy" / "generate"
    with StageLock(stage_url(cfg, "generate"), "stage 'generate' of run 'busy'"):  # a launcher runs it
        (generate / "shard-000000.tar").write_bytes(b"being written")
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "stage 'generate' of run 'busy' is already running (pid" in err[0], err
        code = main([*argv, "--shard-index", "1", "--num-shards", "2"])  # a part, which takes no lock, looks at it
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "stage 'generate' of run 'busy' is running (pid" in err[0], err
        assert (generate / "shard-000000.tar").read_bytes() == b"being written"
        monkeypatch.setenv("WORLD_SIZE", "2")  # a torchrun of its own around `rlaif stage`: its other ranks
        monkeypatch.setenv("RANK", "1")  # would not wait for rank 0's lock
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and "runs under a torchrun of its own here (2 processes): start it with `rlaif launch " \
            "generate`" in err[0], err
        assert (generate / "shard-000000.tar").read_bytes() == b"being written"


def test_a_stage_by_hand_runs_with_the_process_count_its_cache_key_names(tmp_path, monkeypatch):
    from rlaif.orchestration import preflight

    cfg = load_config(TINY, [f"storage.root=file://{tmp_path}"])  # train_rm.nproc=2, ppo.nproc=2
    for name in ("train_rm", "ppo"):
        with pytest.raises(UserError, match=f"^stage '{name}' runs as 2 processes \\({name}.nproc=2\\) and `rlaif "
                                            f"stage` by hand is one: start it with `rlaif launch {name}`, which runs "
                                            f"them under torchrun, or set {name}.nproc=1$"):
            runner.run_stage(cfg, name)
    monkeypatch.setattr(preflight, "gpu_count", lambda: 4)  # one process per GPU there, whatever nproc says
    with pytest.raises(UserError, match="runs as 4 processes \\(one per GPU, 4 here\\) and `rlaif stage` by hand is "
                                        "one: start it with `rlaif launch ppo`, which runs them under torchrun$"):
        runner.run_stage(load_config(TINY, [f"storage.root=file://{tmp_path}", "ppo.nproc=1"]), "ppo")
    assert not (tmp_path / "tiny").exists()
    monkeypatch.setattr(preflight, "gpu_count", lambda: 0)
    one = load_config(TINY, [f"storage.root=file://{tmp_path}", "train_rm.nproc=1"])
    with pytest.raises(UserError, match="run stage 'label' first"):  # its count: on to the stage's own checks
        runner.run_stage(one, "train_rm")


def test_a_stage_by_hand_releases_its_lock_and_a_launched_one_takes_none(tmp_path, monkeypatch):
    cfg = load_config(TINY, [f"storage.root=file://{tmp_path}", "generate.max_prompts=2",
                             "generate.max_new_tokens=4"])
    runner.run_stage(cfg, "generate")  # by hand: takes the lock, and lets it go
    assert not (tmp_path / "tiny" / "generate" / ".lock").exists()
    assert (tmp_path / "tiny" / "generate" / "manifest.json").exists()
    monkeypatch.setenv("RLAIF_CACHE_CHECKED", "")  # a launcher's process: the launcher holds the lock
    with StageLock(stage_url(cfg, "generate"), "stage 'generate' of run 'tiny'"):
        runner.run_stage(cfg.model_copy(update={"seed": 5}), "generate")  # other settings: runs, under its lock


def test_a_large_data_file_edited_in_place_at_its_size_and_mtime_is_a_new_input(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "WHOLE_FILE_LIMIT", 16)  # every file here is "large"
    monkeypatch.setattr(digest, "EDGE", 4)  # the shortcut's first and last bytes
    monkeypatch.setenv("RLAIF_CACHE", str(tmp_path / "cache"))  # where large data files' digests are remembered
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "How do I boil an egg?"}\n{"prompt": "How do I fry an egg?"}\n')
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"head" + b"weights " * 8 + b"tail")

    def digests():
        return source_digest(DataConfig(prompts=str(prompts))), digest.spec_digest(str(model), model=True)

    before = digests()
    time.sleep(0.05)  # the edit at a later tick of the kernel's coarse clock than the first write, as any real edit is
    for path, old, new in ((prompts, b"boil", b"poac"), (weights, b"weights", b"weightz")):
        stat = path.stat()
        path.write_bytes(path.read_bytes().replace(old, new))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p, rsync -a and touch -r leave it
        assert path.stat().st_size == stat.st_size
    after = digests()
    assert after[0] != before[0]  # data: every byte (a stage reads them all anyway), remembered per file version
    assert len(list((tmp_path / "cache" / "digests").iterdir())) == 2
    assert digests() == after  # the remembered digest
    assert after[1] == before[1]  # model weights keep the documented shortcut: size, mtime, first and last MiB


@pytest.fixture
def silent_server():
    """An http server that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    stop = threading.Event()

    def serve():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def test_an_http_input_whose_server_never_answers_fails_in_bounded_time(silent_server, monkeypatch):
    monkeypatch.setattr(storage, "HTTP_TIMEOUTS_S", {"sock_connect": 1, "sock_read": 1})
    start = time.monotonic()
    with pytest.raises(UserError, match=r"^prompts file http://127.0.0.1:\d+/p.jsonl cannot be read \(the server did "
                                        r"not answer in time: .*\): check the URL and that its server is up"):
        load_prompts(DataConfig(prompts=f"{silent_server}/p.jsonl"))
    assert time.monotonic() - start < 30  # a HEAD and a GET of 1 s each; without a bound, aiohttp's 300 s twice
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    with pytest.raises(UserError, match=rf"^prompts file http://127.0.0.1:{port}/p.jsonl cannot be read \(the server "
                                        "cannot be reached"):
        load_prompts(DataConfig(prompts=f"http://127.0.0.1:{port}/p.jsonl"))


def test_an_http_error_is_named_and_a_404_is_not_found(tmp_path):
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status = 403 if "signed" in self.path else 404 if "gone" in self.path else 200
            body = b'{"prompt": "How do I boil an egg?"}\n' if status == 200 else b"no"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(UserError, match=r"^prompts file .*/signed.jsonl cannot be read \(the server answered 403 "
                                            r"Forbidden\): check the URL"):
            load_prompts(DataConfig(prompts=f"{base}/signed.jsonl"))
        with pytest.raises(UserError, match=r"^prompts file not found: .*/gone.jsonl"):
            load_prompts(DataConfig(prompts=f"{base}/gone.jsonl"))
        assert [row["prompt"] for row in load_prompts(DataConfig(prompts=f"{base}/p.jsonl"))] == ["How do I boil an "
                                                                                                   "egg?"]
    finally:
        server.shutdown()


@pytest.mark.parametrize("argv, needle", [
    (["run", "--config", TINY, "--rerun", "bogus"], "rlaif run: argument --rerun: invalid choice"),
    (["stage", "generate", "--config", TINY, "--shard-index", "-1"], "rlaif stage: argument --shard-index: -1 is "),
    ([], "rlaif: the following arguments are required: command"),
    (["lanch"], "rlaif: argument command: invalid choice"),
])
def test_command_line_errors_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {needle}"), err
    assert err[0].endswith("--help)")


def wandb_check(tmp_path, launched: str | None = None, **env) -> subprocess.CompletedProcess:
    """In a fresh process (wandb reads its settings once per process) whose HOME and, for the W&B check alone,
    working directory are tmp_path, with no W&B variable but those given: preflight.check of a W&B-tracked launch of
    stage `launched` (from the repository: the config's data paths), or without it the W&B check alone."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    cfg = f"load_config({str(REPO / TINY)!r}, ['storage.root=file://{tmp_path}/runs', 'tracking.report_to=[wandb]'])"
    code = (f"from rlaif.orchestration import preflight; preflight.check({cfg}, launched={launched!r})" if launched
            else f"from rlaif import tracking; tracking.check_wandb_credentials({cfg}.tracking)")
    return subprocess.run([sys.executable, "-c", "from rlaif.config import load_config; " + code],
                          cwd=REPO if launched else tmp_path, capture_output=True, text=True, timeout=120,
                          env={**clean, "HOME": str(tmp_path), **env})


def test_wandb_without_a_key_is_refused_before_any_stage(tmp_path):
    pytest.importorskip("wandb")
    refused = wandb_check(tmp_path, "train_rm")
    assert refused.returncode == 1 and "UserError: tracking.report_to has wandb, and W&B finds no API key here for " \
        "http" in refused.stderr and "(WANDB_API_KEY, or `wandb login`): set one, or WANDB_MODE=offline" in \
        refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "runs").exists()
    assert wandb_check(tmp_path, "generate").returncode == 0  # a stage that opens no tracker
    for env in ({"WANDB_MODE": "offline"}, {"WANDB_API_KEY": "k" * 40}):
        assert wandb_check(tmp_path, **env).returncode == 0, env
    host = "wandb.example.com:8080"  # `wandb login --host` writes the host with its port
    (tmp_path / ".netrc").write_text(f"machine {host} login user password {'k' * 40}\n")
    (tmp_path / ".netrc").chmod(0o600)
    found = wandb_check(tmp_path, WANDB_BASE_URL=f"http://{host}")
    assert found.returncode == 0, found.stderr[-2000:]
    assert wandb_check(tmp_path, WANDB_BASE_URL="http://other.example.com").returncode == 1
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "settings").write_text("[default]\nmode = offline\n")  # `wandb offline` here
    offline = wandb_check(tmp_path, WANDB_BASE_URL="http://other.example.com")
    assert offline.returncode == 0, offline.stderr[-2000:]


def test_a_full_disk_names_the_output_it_was_writing(tmp_path, monkeypatch):
    import errno
    import shutil

    from rlaif.io.disk_problems import disk_problem

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # as sendfile and write raise it: no file named

    source = tmp_path / "shard.tar"
    source.write_bytes(b"x")
    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(OSError) as raised:
        storage.upload_file(source, f"file://{tmp_path}/run/generate/shard-000000.tar")
    assert disk_problem(raised.value) == (f"cannot write {tmp_path}/run/generate/shard-000000.tar: No space left on "
                                          "device: free space there, or point storage.root, TMPDIR or RLAIF_CACHE at "
                                          "a disk with room")
    monkeypatch.setattr(type(tmp_path), "write_bytes", full)
    with pytest.raises(OSError, match="manifest.json"):
        storage.write_bytes_atomic(f"file://{tmp_path}/run/generate/manifest.json", b"{}")
    assert sorted(p.name for p in (tmp_path / "run" / "generate").iterdir()) == []  # no partial file left


def test_a_reference_answer_with_no_word_to_match_is_refused():
    from rlaif.judges.reference import check_points

    check_points([{"id": "a", "prompt": "Boil an egg?", "reference": "Boil water. Add the egg."}])
    check_points([{"id": "b", "prompt": "Boil an egg?", "key_points": ["Boil water"], "reference": "It is."}])
    with pytest.raises(UserError, match="^judge 'reference': the reference answer 'It is what it is.' of prompt 'c' "
                                        "has no word it can match"):  # evaluate left the reference judge out, silently
        check_points([{"id": "c", "prompt": "Boil an egg?", "reference": "It is what it is."}])

"""What a launcher costs before its stage starts: `rlaif launch` checks a config without importing torch (the stage
process imports it; the launcher loads no model), and a stage of one process runs without a torchrun agent."""
import subprocess
import sys
import textwrap
from pathlib import Path

from rlaif.graph import STAGE_BY_NAME
from rlaif.orchestration import launch

REPO = Path(__file__).resolve().parents[2]


def test_the_launchers_checks_import_neither_torch_nor_transformers(tmp_path):
    # The reward-model backbone's fit (MiniLM's positions) was read through AutoConfig, which imports torch; the GPU
    # count through torch.cuda. Seconds for every `rlaif launch`, a KFP or Airflow step's whole start.
    code = textwrap.dedent(f"""
        import sys
        from rlaif.config import load_config
        from rlaif.graph import STAGE_BY_NAME
        from rlaif.orchestration import preflight
        preflight.GPU_DEVICE_FILES = ()  # this machine as one without GPUs; where there are, torch counts them
        cfg = load_config("configs/tiny.yaml", ["storage.root=file://{tmp_path}", "train_rm.student.layers=2"])
        preflight.check(cfg)
        assert preflight.processes_per_node(STAGE_BY_NAME["ppo"], cfg) == cfg.ppo.nproc
        from rlaif.judges.openai import OpenAIJudge  # the launcher's check of an endpoint judge builds one
        print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_a_stage_of_one_process_runs_without_torchrun():
    url = "file:///runs/r/config.yaml"
    for name in ("generate", "train_rm", "ppo", "label"):
        assert launch.command(STAGE_BY_NAME[name], url, 1) == [sys.executable, "-m", "rlaif", "stage", name,
                                                               "--config", url]
    assert launch.command(STAGE_BY_NAME["ppo"], url, 2)[:5] == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def failure(rank: int, code: int) -> str:
    """One failure as torchrun's report lists it (torch/distributed/elastic/multiprocessing/errors)."""
    return (f"[{rank}]:\n  time      : 2026-11-30_10:50:00\n  host      : node\n  rank      : {rank} (local_rank: "
            f"{rank})\n  exitcode  : {code} (pid: {100 + rank})\n  error_file: <N/A>\n  traceback : To enable "
            "traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")


def torchrun_report(root: str, others: list[str]) -> bytes:
    rule = "-" * 60 + "\n"
    return ("=" * 60 + "\nrlaif FAILED\n" + rule + "Failures:\n" + ("".join(others) or "  <NO_OTHER_FAILURES>\n")
            + rule + "Root Cause (first observed failure):\n" + root + "=" * 60 + "\n").encode()


def test_the_rank_that_ended_a_stage_is_read_from_torchruns_report():
    from rlaif.orchestration.launch import root_cause

    assert root_cause(torchrun_report(failure(1, -9), [])) == (1, -9)
    assert root_cause(torchrun_report(failure(0, 1), [])) == (0, 1)  # a crash: its traceback is in its own output
    # rank 1 was killed; rank 0 failed on the lost connection in the same second and is listed as the root cause
    assert root_cause(torchrun_report(failure(0, 1), [failure(1, -9)])) == (1, -9)
    # the agent's SIGTERM to the other ranks is not why the stage ended
    assert root_cause(torchrun_report(failure(0, 1), [failure(1, -15)])) == (0, 1)
    assert root_cause(b"Traceback (most recent call last):\n  a crash of torchrun itself\n") is None

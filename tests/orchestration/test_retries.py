"""A KFP step's automatic retries after its stage ran and ended in a user error: raised again at once (KFP retries
exit code 2 too: a failed quality gate was evaluated three times), past them the stage runs again."""
import pytest

from rlaif.errors import UserError
from rlaif.orchestration import retries


def test_a_kfp_steps_retries_raise_the_recorded_error_then_the_stage_runs_again(tmp_path, monkeypatch):
    stage = f"file://{tmp_path}/run/evaluate"
    (tmp_path / "run/evaluate").mkdir(parents=True)
    monkeypatch.setenv("RLAIF_LOCK_OWNER", "kfp:rlaif-run-7:evaluate")
    monkeypatch.delenv("RLAIF_CLUSTER_JSON", raising=False)  # the default cluster settings: 2 retries
    retries.record(stage, "key-1", "quality gate failed: win rate 0.41 < evaluate.min_win_rate 0.6")
    for _ in range(2):  # KFP's two automatic retries
        with pytest.raises(UserError, match=r"^quality gate failed: win rate 0.41 < evaluate.min_win_rate 0.6 \(this "
                                            r"step's previous attempt ran the stage and ended so"):
            retries.raise_if_repeated(stage, "key-1")
    retries.raise_if_repeated(stage, "key-1")  # a retry the user starts later runs the stage
    assert not (tmp_path / "run/evaluate" / retries.RECORD).exists()

    retries.record(stage, "key-1", "gate")
    retries.raise_if_repeated(stage, "key-2")  # other settings or inputs: runs, and the record goes
    assert not (tmp_path / "run/evaluate" / retries.RECORD).exists()
    retries.record(stage, "key-1", "gate")
    monkeypatch.setenv("RLAIF_LOCK_OWNER", "kfp:rlaif-run-8:evaluate")  # another run's step
    retries.raise_if_repeated(stage, "key-1")
    (tmp_path / "run/evaluate" / retries.RECORD).write_text("{not json")
    monkeypatch.setenv("RLAIF_LOCK_OWNER", "kfp:rlaif-run-7:evaluate")
    retries.raise_if_repeated(stage, "key-1")  # a damaged record is no reason to fail


@pytest.mark.parametrize("owner", ["", "airflow:rlaif:manual__1:evaluate"])
def test_nothing_outside_a_kfp_step_records(tmp_path, monkeypatch, owner):
    """`rlaif run` runs the stage every time it is asked; Airflow does not retry exit code 2, and a task the user
    clears after fixing the cause must run."""
    monkeypatch.setenv("RLAIF_LOCK_OWNER", owner)
    (tmp_path / "evaluate").mkdir()
    retries.record(f"file://{tmp_path}/evaluate", "key", "gate")
    assert not any((tmp_path / "evaluate").iterdir())

"""Every command that takes a run id checks it by one rule (the config's run_id) and refuses a bad one: a run id names
a directory under the storage root, so a rewritten one (`../escape` -> `escape`) would be a directory the user did not
name."""
import re

import pytest

from rlaif.cli import main
from rlaif.orchestration import launch

TINY = "configs/tiny.yaml"
RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # RULE's words
RULE = "use 1-128 letters, digits, '-', '_' and '.' (not first): one directory name"


def commands(root: str, run_id: str) -> dict[str, list[str]]:
    common = ["--config", TINY, "--storage-root", root]
    return {"run": ["run", *common, "--run-id", run_id],
            "launch": ["launch", "generate", *common, "--run-id", run_id],
            "submit": ["submit", "kfp", "--endpoint", "http://127.0.0.1:9", *common, "--run-id", run_id]}


@pytest.mark.parametrize("run_id", ["../escape", "exp 1", ".hidden", "a/b", "x" * 129])
@pytest.mark.parametrize("command", ["run", "launch", "submit"])
def test_a_bad_run_id_is_refused_by_every_command(tmp_path, capsys, command, run_id):
    root = tmp_path / "root"
    assert main(commands(f"file://{root}", run_id)[command]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --run-id {run_id!r}: {RULE}"
    assert not root.exists() and not (tmp_path / "escape").exists()  # refused before anything is written


def test_stage_checks_a_run_id_set_by_the_same_rule(tmp_path, capsys):
    assert main(["stage", "generate", "--config", TINY, "--set", "run_id=../escape"]) == 2
    assert RULE in capsys.readouterr().err


def test_an_orchestrators_run_name_is_made_safe_only_as_a_default(tmp_path, monkeypatch):
    """Airflow's dag_run.run_id is not a directory name: launch makes it one, but only as --default-run-id."""
    launched = []
    monkeypatch.setattr(launch, "prepare", lambda cfg, **kwargs: "config-url")
    monkeypatch.setattr(launch, "launch", lambda cfg, name, url, rerun: launched.append(cfg.run_id) or {"digest": ""})
    base = ["launch", "generate", "--config", TINY, "--storage-root", f"file://{tmp_path}"]
    assert main([*base, "--default-run-id", "scheduled__2026-11-22T00:00:00+00:00"]) == 0
    assert main([*base, "--run-id", "exp-7", "--default-run-id", "scheduled__2026-11-22T00:00:00+00:00"]) == 0
    assert launched[1] == "exp-7" and re.fullmatch(r"scheduled__2026-11-22T00-00-00-00-00-[0-9a-f]{8}", launched[0])


def test_run_names_that_had_to_change_stay_apart():
    """A KFP or Airflow run named in another script was cut to `run`, and names differing only in punctuation (KFP's
    default names hold spaces and parentheses) or past 128 characters mapped to one id: two runs shared one directory,
    the second replacing the first's outputs. A name that is already a run id is kept as it is."""
    from rlaif.config import safe_run_id

    names = ["實驗一", "實驗二", "exp-實驗", "exp-實驗2", "é", "ü", "exp 1", "exp:1", "exp/1", "exp-1.", "....", "//",
             "x" * 300, "x" * 128 + "y", "實" * 300 + "x" * 300]
    ids = [safe_run_id(name) for name in names]
    assert len(set(ids)) == len(ids) and ids[0].startswith("run-") and ids[2].startswith("exp-")
    assert all(RUN_ID.fullmatch(i) and len(i) <= 128 for i in ids) and safe_run_id("實驗一") == ids[0]
    assert "exp-1" not in ids and all(safe_run_id(name) == name for name in ("exp-1", "Exp_1.v2", "x" * 128))
    assert re.fullmatch(r"manual__2026-11-22T08-00-00-00-00-[0-9a-f]{8}",
                        safe_run_id("manual__2026-11-22T08:00:00+00:00"))


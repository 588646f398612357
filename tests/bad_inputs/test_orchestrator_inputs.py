"""What a launcher and an orchestrator hand a stage: settings a stage was not started with, a flag and a --set of
one setting, a pipeline step's own settings against the run's, parameters as a KFP or Airflow form sends them (items
that are not strings, a cleared config, locations with a space at an end), a setting given twice, and a run id the
user gave against the orchestrator's run name. Each: exit 2 and one line, or the value read as written."""

import pytest

from rlaif.config import load_config
from rlaif.config.loading import refuse_repeated_keys
from rlaif.errors import UserError
from rlaif.io import storage
from rlaif.orchestration import kfp_steps, launch

TINY = "configs/tiny.yaml"


def test_a_stage_refuses_settings_its_launcher_did_not_start_it_with(cli, tmp_path, monkeypatch):
    """Between two stages of `rlaif run` no stage lock is held, and another launcher of the run with other settings
    could rewrite config.yaml: the next stage, which reads config.yaml, ran those settings under the first run's name
    (and its evaluation was printed as the first run's). The stage compares the config with its launcher's."""
    from rlaif.stages.common import LAUNCHED_CONFIG, launched_config

    root = f"file://{tmp_path}"
    ours = load_config(TINY, [f"storage.root={root}", "run_id=shared"])
    config_url = launch.prepare(ours)
    monkeypatch.setenv(LAUNCHED_CONFIG, launched_config(ours))
    storage.write_bytes_atomic(config_url, storage.read_bytes(config_url).replace(b"iterations: 2", b"iterations: 3"))
    cli("stage", "generate", "--config", config_url, needle="the config.yaml of run 'shared' was rewritten with other "
        "settings by another launcher while this run went on")
    assert not storage.exists(f"{root}/shared/generate")
    streamed = load_config(TINY, [f"storage.root={root}", "run_id=shared", "label.streaming=true"])
    assert launched_config(streamed) == launched_config(ours)  # how a stage runs (KFP's label pod streams) may differ


def test_a_flag_and_a_set_of_the_same_setting_must_agree(cli, tmp_path):
    """--run-id aa --set run_id=bb ran as aa, and --storage-root beside --set storage.root kept the flag's: silently."""
    root = f"file://{tmp_path}/root"
    cli("run", "--config", TINY, "--run-id", "aa", "--set", "run_id=bb", "--storage-root", root,
        needle="--run-id aa and --set run_id=bb name two values of run_id: give one of them")
    cli("launch", "generate", "--config", TINY, "--storage-root", root, "--set", f"storage.root=file://{tmp_path}/b",
        needle=f"--storage-root {root} and --set storage.root=file://{tmp_path}/b name two values of storage.root")
    cli("run", "--config", TINY, "--storage-root", root, "--set", f"storage . root=file://{tmp_path}/b",
        needle=f"--storage-root {root} and --set storage . root=file://{tmp_path}/b name two values of storage.root")
    assert not (tmp_path / "root").exists() and not (tmp_path / "b").exists()
    cli("run", "--config", TINY, "--run-id", "aa", "--set", "run_id=aa", "--storage-root", root, "--set",
        "seed=x", needle="'seed'")  # the same value twice is no conflict: the next check speaks


def test_a_pipeline_steps_own_settings_win_over_the_runs(monkeypatch, tmp_path):
    """A streaming DAG launches label with `--set label.streaming=true` after the run's overrides: a run's
    label.streaming=false was refused as two values of one setting. Under --pipeline the step's own --set items win
    (as KFP's typed parameters do); outside it, and within each group, two values are still refused."""
    from rlaif.orchestration import launch

    seen = []
    monkeypatch.setattr(launch, "prepare", lambda cfg, **kwargs: seen.append(cfg.label.streaming) or "config-url")
    monkeypatch.setattr(launch, "launch", lambda cfg, name, url, rerun: {"digest": ""})
    base = ["launch", "label", "--config", TINY, "--storage-root", f"file://{tmp_path}"]
    from rlaif.cli import main

    assert main([*base, "--pipeline", "--set-json", '["label.streaming=false"]', "--set", "label.streaming=true"]) == 0
    assert seen == [True]
    assert main([*base, "--set-json", '["label.streaming=false"]', "--set", "label.streaming=true"]) == 2
    assert main([*base, "--pipeline", "--set-json", '["seed=1", "seed=2"]']) == 2


def test_orchestrator_parameters_as_a_ui_sends_them_are_one_line(cli, tmp_path, monkeypatch, capsys):
    """What a KFP or Airflow form can hold: an overrides item that is not a string (a traceback, then KFP retried the
    step), a cleared config field (the built-in defaults ran, 143 s, unasked), a pasted storage root with a space or
    line break at its end (a directory named ' ' in the pod's working directory, lost with the pod), a config path
    pasted with a line break (read as YAML)."""
    from rlaif.orchestration.launch import load_config_source

    root = f"file://{tmp_path}/root"
    monkeypatch.setenv("RLAIF_LOCK_OWNER", "kfp:test")
    for overrides, config, storage_root, needle in (
            ([1, {"a": 2}], TINY, root, "error: overrides item 0 is 1, not a KEY=VALUE string"),
            ([], "", root, "error: the config is empty: name a YAML config file"),
            ([], "  \n", root, "error: the config is empty"),
            ([], TINY, "  ", "'storage.root': '  ' has a space or line break at its start or end: remove it"),
            ([], TINY, root + "\n", "has a space or line break at its start or end")):
        with pytest.raises(SystemExit) as refused:
            kfp_steps.run_component("generate", config, overrides, "", storage_root, "kfp-run", {}, None, {})
        err = capsys.readouterr().err
        assert refused.value.code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "root").exists() and not list(tmp_path.glob(" *"))
    cli("launch", "generate", "--config", TINY, "--storage-root", " ", needle="has a space or line break")
    cli("run", "--config", TINY, "--set", "storage.root=' file://x'", needle="has a space or line break")
    for location in ("policy.model", "label.hf.model", "train_rm.backbone", "label.constitution", "label.few_shot",
                     "policy.tiny.demonstrations", "data.data_files", "label.openai.model"):
        with pytest.raises(UserError, match=f"'{location}': 'x ' has a space or line break at its start or end"):
            load_config(TINY, [f"{location}='x '"])
    assert load_config_source(TINY + "\n", [], "", root).run_id == load_config(TINY).run_id  # a path, not YAML
    assert load_config_source("seed: 7\n").seed == 7  # YAML text on one line with its line break: still YAML
    assert load_config_source("storage: {root: 's3://b/x'}\n").storage.root == "s3://b/x"  # a URL inside: still YAML


def test_a_setting_given_twice_is_refused_and_a_mapping_sets_only_its_keys(cli, tmp_path, monkeypatch, capsys):
    """`--set ppo.lr=1e-5 --set ppo.lr=2e-5` ran with the last value, and `--set 'ppo={lr: 1e-5}'` reset every other
    ppo setting of the config file to its default (2 iterations became 40): both silently. The same value twice is
    no conflict."""
    root = f"file://{tmp_path}/root"
    cli("run", "--config", TINY, "--storage-root", root, "--set", "ppo.lr=1e-5", "--set", "ppo . lr=2e-5",
        needle="--set ppo.lr=1e-5 and --set ppo . lr=2e-5 set ppo.lr to two values: give one")
    cli("launch", "generate", "--config", TINY, "--storage-root", root, "--set", "seed=1", "--set-json", '["seed=2"]',
        needle="--set seed=1 and --set seed=2 set seed to two values: give one")
    monkeypatch.setenv("RLAIF_LOCK_OWNER", "kfp:test")  # the user's overrides of a KFP step: refused the same way,
    with pytest.raises(SystemExit) as refused:  # in one line (KFP's executor printed a traceback)
        kfp_steps.run_component("generate", TINY, ["ppo.lr=1", "ppo.lr=2"], "", root, "kfp-run", {}, None, {})
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("error: --set ppo.lr=1 and --set ppo.lr=2 set ppo.lr to two")
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "root").exists()
    refuse_repeated_keys(["seed=1", "seed= 1", "ppo.lr=1e-5", "ppo.lr = 1e-5"])  # one value each: accepted
    # one reading of a key for the check and the config: `ppo . lr` is ppo.lr in both (it was 'ppo ' in the config)
    assert load_config(TINY, ["ppo . lr=2e-5"]).ppo.lr == 2e-5
    refuse_repeated_keys(["ppo={lr: 1e-5}", "ppo={kl_coef: 0.1}", "ppo.lr=1e-5"])  # a mapping is the keys it names
    with pytest.raises(UserError, match="--set ppo.lr=1 and --set ppo={lr: 2} set ppo.lr to two values"):
        refuse_repeated_keys(["ppo.lr=1", "ppo={lr: 2}"])
    # A run_id among a KFP step's overrides names the run, as with `rlaif launch` (the KFP run's name did)
    with pytest.raises(SystemExit):
        kfp_steps.run_component("label", TINY, ["run_id=mine"], "", root, "kfp-run-7", {}, None, {})
    assert f"{tmp_path}/root/mine/generate/manifest.json does not exist" in capsys.readouterr().err

    given = load_config(TINY)
    merged = load_config(TINY, ["ppo={lr: 1e-5}", "policy={tiny: {hidden_size: 32}}"])
    assert merged.ppo.lr == 1e-5 and merged.policy.tiny.hidden_size == 32
    assert merged.ppo.model_dump(exclude={"lr"}) == given.ppo.model_dump(exclude={"lr"})
    assert merged.policy.tiny.model_dump(exclude={"hidden_size"}) == given.policy.tiny.model_dump(
        exclude={"hidden_size"})


def test_a_run_id_the_user_gave_beats_the_orchestrators_run_name(cli, tmp_path):
    """The Airflow tasks pass the DAG run's name as --default-run-id; overrides naming run_id lost to it, and
    --set-json items beside --run-id went unchecked."""
    root = f"file://{tmp_path}/root"
    cli("launch", "generate", "--config", TINY, "--storage-root", root, "--run-id", "aa", "--set-json",
        '["run_id=bb"]', needle="--run-id aa and --set run_id=bb name two values of run_id")
    cli("launch", "label", "--config", TINY, "--storage-root", root, "--default-run-id", "manual__2026", "--set-json",
        '["run_id=mine"]', needle="/root/mine/generate/manifest.json does not exist")  # run 'mine', not manual__2026

"""Refusals that must name the right thing: a constitution of plain strings is told to write mappings, a repeated
principle text is named, --set on a value (not a section) suggests that value's own form, a mapping where a list
goes is called a mapping, and a key that differs only in case is suggested; and a reward-model batch larger than the
prompts can fill is refused before generate."""
from pathlib import Path

import pytest

TINY = "configs/tiny.yaml"


@pytest.fixture
def root(tmp_path):
    return ("--storage-root", f"file://{tmp_path}/root")


@pytest.mark.parametrize("text, needle", [
    ("- Be helpful.\n- Be kind.\n", "principle 1 is a plain string: write each principle as a mapping"),
    ("- [a, b]\n", "principle 1 is a list: write each principle as a mapping"),
    ("- name: a\n  text: Be  helpful.\n- name: b\n  text: Be kind.\n- name: c\n  text: be helpful.\n",
     "principles 1 and 3 say the same: keep one"),
])
def test_constitution_shapes_are_named(cli, root, tmp_path, text, needle):
    path = tmp_path / "constitution.yaml"
    path.write_text(text)
    cli("launch", "generate", "--config", TINY, *root, "--set", f"label.constitution={path}", needle=needle)
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("override, needle", [
    ("seed.x=1", "--set seed.x: 'seed' is a value, not a section: give its whole value, e.g. --set seed=VALUE"),
    ("generate.stop.0.z=1", "e.g. --set generate.stop=[a, b] (items are not set one by one)"),
    ("generate.stop={a: 1}", "'generate.stop': Input should be a valid list: it was given a mapping: give a YAML "
                             "list"),
    ("Seed=3", "unknown config key 'Seed' (did you mean 'seed'?)"),
    ("PPO.lr=1e-5", "unknown config key 'PPO' (did you mean 'ppo'?)"),
])
def test_set_messages_fit_the_key(cli, root, tmp_path, override, needle):
    config = tmp_path / "config.yaml"
    config.write_text("seed: 3\ngenerate:\n  stop: ['x']\n")
    cli("launch", "generate", "--config", str(config), *root, "--set", override, needle=needle)


def test_too_few_prompts_for_the_reward_models_batch_is_refused_before_generate(cli, root, tmp_path):
    """train_rm would say so only after generate and label had run: it can train on at most one pair per prompt."""
    lines = Path("data/prompts.jsonl").read_text().splitlines()[:12]
    prompts = tmp_path / "few.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    cli("run", "--config", TINY, *root, "--set", f"data.prompts={prompts}", "--set", "data.eval_fraction=0.5",
        needle="at most 4 training pairs for train_rm.batch_size=8 (5 of the 12 prompts are training prompts at "
               "data.eval_fraction=0.5; one pair per training prompt, 0.1 of them held out): add prompts, lower "
               "data.eval_fraction")
    cli("run", "--config", TINY, *root, "--set", "generate.max_prompts=5",
        needle="(generate.max_prompts=5 of the 2498 training prompts; one pair per training prompt, 0.1 of them "
               "held out): raise generate.max_prompts")
    cli("run", "--config", TINY, *root, "--set", "data.eval_fraction=0.999",  # the split, not the batch, is the cause
        needle="at most 0 training pairs for train_rm.batch_size=8 (1 of the 2780 prompts are training prompts at "
               "data.eval_fraction=0.999;")
    assert not (tmp_path / "root").exists()


def test_a_policy_on_s3_that_is_not_there_is_refused_before_any_work(cli, root, tmp_path, s3_endpoint, monkeypatch):
    """s3:// models are downloaded by the stage that loads them: that one is there is checked at launch."""
    from rlaif.io import storage

    endpoint, bucket = s3_endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    storage.configure(endpoint)
    cli("run", "--config", TINY, *root, "--set", f"policy.model=s3://{bucket}/models/none-{tmp_path.name}",
        needle=f"policy model s3://{bucket}/models/none-{tmp_path.name} holds no config.json")
    cli("run", "--config", TINY, *root, "--set", f"policy.model=s3://no-such-bucket-{tmp_path.name}/policy",
        needle="policy model s3://no-such-bucket-")
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("args, variable", [(("--storage-root", "${HOME}/runs"), "${HOME}"),
                                            (("--set", "data.prompts=$DATA/prompts.jsonl"), "$DATA"),
                                            (("--set", "label.constitution=s3://${BUCKET}/c.yaml"), "${BUCKET}")])
def test_an_environment_variable_in_a_path_is_named_not_taken_literally(cli, tmp_path, monkeypatch, args, variable):
    monkeypatch.setenv("DATA", "/data")  # $NAME is named where NAME is set; ${NAME} always
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # where a literal `${HOME}` directory would have been made
    prompts = [] if args[1].startswith("data.prompts=") else ["--set", f"data.prompts={repo / 'data/prompts.jsonl'}"]
    cli("run", "--config", str(repo / TINY), "--storage-root", str(tmp_path / "root"), *prompts, *args,
        needle=f"holds {variable}, an environment variable, which is not expanded here: write the path out")
    assert list(tmp_path.iterdir()) == []


def test_what_stays_valid_beside_these_refusals(tmp_path, monkeypatch):
    """A '$' that is no set variable's (an S3 key `team$ml`), a glob's '?' and a file name's '#' in data.prompts, a
    database tracking URI's query, and two principles of one text with different contrasts."""
    from rlaif.config import load_config
    from rlaif.io import storage
    from rlaif.judges.constitution import load_constitution

    monkeypatch.delenv("ml", raising=False)
    assert storage.normalize("s3://bucket/team$ml/runs") == "s3://bucket/team$ml/runs"
    cfg = load_config(TINY, ["data.prompts=s3://bucket/part-000?.parquet", "tracking.mlflow_tracking_uri="
                             "postgresql://db:5432/mlflow?sslmode=require", f"storage.root={tmp_path}/a#b"])
    assert cfg.data.prompts.endswith("?.parquet") and cfg.tracking.mlflow_tracking_uri.endswith("sslmode=require")
    path = tmp_path / "constitution.yaml"
    path.write_text("- text: Be brief.\n  contrast: a rambling answer\n- text: Be brief.\n  contrast: a rude one\n")
    assert len(load_constitution(str(path))) == 2


def test_a_cluster_file_given_as_the_config_is_named_as_such(cli, tmp_path):
    from dataclasses import fields

    from rlaif.config import config_fields
    from rlaif.config.loading import CLUSTER_KEYS
    from rlaif.orchestration.cluster import ClusterSpec

    # in step with the cluster file's settings, and none of them a config section
    assert CLUSTER_KEYS <= {f.name for f in fields(ClusterSpec)}
    assert not CLUSTER_KEYS & {key.split(".")[0] for key, *_ in config_fields()}
    cli("compile", "kfp", "-o", str(tmp_path / "p.yaml"), "--config", "configs/cluster.yaml",
        needle="it is a cluster setting (configs/cluster.yaml): give that file as --cluster, not as --config")
    assert not (tmp_path / "p.yaml").exists()

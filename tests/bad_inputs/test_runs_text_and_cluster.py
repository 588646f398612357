"""Classes a fifth probe found: a second launch rewriting the settings of a run in progress, a closed output pipe
ending a run with exit 0, paths of the wrong kind (a file where the run tree holds a directory), chat templates that
fail or drop the prompt, line splits at Unicode boundaries inside prompts and JSON strings, YAML 1.1 readings of
`--set` values (octal, base 60) and of text fields, and cluster settings Kubernetes would refuse or that would put a
credential in plain text. Each: exit 2 and one line, or the value read as written."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlaif import runner
from rlaif.config import PolicyConfig, load_config
from rlaif.errors import UserError
from rlaif.io import storage
from rlaif.io.lock import StageLock
from rlaif.io.prompts import load_prompts
from rlaif.orchestration import cluster, launch, preflight
from rlaif.stages.common import run_url, stage_url

TINY = "configs/tiny.yaml"


def test_a_run_in_progress_keeps_its_settings(tmp_path):
    cfg = load_config(TINY, [f"storage.root=file://{tmp_path}", "run_id=busy"])
    launch.prepare(cfg)
    config_url = storage.join(f"file://{tmp_path}", "busy", "config.yaml")
    written = storage.read_bytes(config_url)
    with StageLock(stage_url(cfg, "train_rm"), "stage 'train_rm' of run 'busy'"):  # this process runs the run
        launch.prepare(cfg)  # the same settings: another launcher of the same run may start its stages
        # a streaming pipeline's label task adds label.streaming, a runtime setting, for itself alone
        launch.prepare(load_config(TINY, [f"storage.root=file://{tmp_path}", "run_id=busy", "label.streaming=true"]))
        written = storage.read_bytes(config_url)
        other = load_config(TINY, [f"storage.root=file://{tmp_path}", "run_id=busy", "ppo.lr=2e-5"])
        with pytest.raises(UserError, match="run 'busy' is running with other settings \\(stage 'train_rm', pid"):
            launch.prepare(other)
    assert storage.read_bytes(config_url) == written
    with StageLock(run_url(cfg), "run 'busy'"):  # `rlaif run` between two stages: no stage is held then
        with pytest.raises(UserError, match="run 'busy' is running with other settings \\(`rlaif run`, pid"):
            launch.prepare(other)
        with pytest.raises(UserError, match="run 'busy' is already running \\(pid"):  # a second `rlaif run`
            runner.run(other)
    assert storage.read_bytes(config_url) == written and not storage.exists(stage_url(cfg, "generate"))
    launch.prepare(other)  # once nothing runs, the run takes the new settings (and its stages re-run where changed)
    assert storage.read_bytes(config_url) != written


@pytest.mark.parametrize("command, code", [(["run", "--config", TINY, "--storage-root"], 2), (["config"], 0)])
def test_a_closed_output_pipe(tmp_path, command, code):
    where = [f"file://{tmp_path}"] if command[0] == "run" else []
    proc = subprocess.Popen([sys.executable, "-m", "rlaif", *command, *where], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader left (`| head` done) before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == code, err
    assert "Traceback" not in err
    if code:
        assert err.strip().splitlines()[-1].startswith("error: `rlaif run` stopped: a pipe it wrote to was closed")
        assert not list(tmp_path.rglob("manifest.json"))


def test_paths_of_the_wrong_kind(cli, tmp_path):
    root = tmp_path / "root"
    (root / "r1").mkdir(parents=True)
    (root / "r1/generate").write_text("x")
    cli("run", "--config", TINY, "--storage-root", str(root), "--run-id", "r1",
        needle="r1/generate/manifest.json: part of this path is a file where a directory is expected")
    (root / "r2/config.yaml").mkdir(parents=True)
    cli("run", "--config", TINY, "--storage-root", str(root), "--run-id", "r2",
        needle="r2/config.yaml: this is a directory where a file is expected: move it away")
    (root / "r3").write_text("x")
    cli("run", "--config", TINY, "--storage-root", str(root), "--run-id", "r3",
        needle="r3: this exists and is not the directory expected here")


@pytest.fixture
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")


@pytest.mark.parametrize("template, needle", [
    ("{% for m in messages %}{{ m.content }", "the policy's chat template fails (TemplateSyntaxError"),
    ("{{ raise_exception('no system turns') }}", "the policy's chat template fails (TemplateError: no system turns"),
    ("Question: hello\nAnswer:", "the policy's chat template leaves the prompt out of its text"),
])
def test_chat_templates_that_fail_or_drop_the_prompt(tokenizer, template, needle):
    from rlaif.models.prompt_text import format_prompts

    tokenizer.chat_template = template
    with pytest.raises(UserError, match="set policy.chat_template=false") as refused:
        format_prompts(tokenizer, PolicyConfig(), ["How do I fix a bike?"])
    assert needle in str(refused.value)
    tokenizer.chat_template = "{% for m in messages %}<|user|>{{ m['content'] | trim }}{% endfor %}<|assistant|>"
    assert format_prompts(tokenizer, PolicyConfig(), [" How do I fix a bike? "]) == [
        "<|user|>How do I fix a bike?<|assistant|>"]
    tokenizer.chat_template = "{% for m in messages %}<u>{{ m['content'].replace('  ', ' ') }}{% endfor %}<a>"
    assert format_prompts(tokenizer, PolicyConfig(), ["How  do I fix a bike?"]) == ["<u>How do I fix a bike?<a>"]


def test_lines_split_at_line_feeds_only(tmp_path):
    rows = [{"id": f"p{k}", "prompt": f"How do I do task {k}?"} for k in range(40)]
    rows[7]["prompt"] = "line\u2028separator inside"
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    loaded = load_prompts(load_config(TINY, [f"data.prompts={jsonl}"]).data)
    assert len(loaded) == 40 and loaded[7]["prompt"] == "line\u2028separator inside"
    text = tmp_path / "prompts.txt"
    text.write_text("".join(f"{r['prompt']}\n" for r in rows[:38]) + "How do I\x0cfix a bike?\nWhat is\u2028this\n",
                    encoding="utf-8")
    loaded = load_prompts(load_config(TINY, [f"data.prompts={text}"]).data)
    assert [row["prompt"] for row in loaded[-2:]] == ["How do I\x0cfix a bike?", "What is\u2028this"]
    assert len(loaded) == 40
    text.write_text("".join(f"{r['prompt']}\r" for r in rows) + "\u200b\r", encoding="utf-8")  # old Mac line ends
    assert [row["prompt"] for row in load_prompts(load_config(TINY, [f"data.prompts={text}"]).data)] == [
        r["prompt"] for r in rows]  # the invisible last line is a blank line


@pytest.mark.parametrize("override, needle", [
    ("seed=12:30", "'seed': Input should be a valid integer"),  # YAML 1.1 base 60 would be 750
    ("seed=0x10", "'seed': Input should be a valid integer"),
    ("=3", "--set '=3': the key has an empty part"),
    (".ppo=3", "the key has an empty part"),
    ("run_id=2026-01-01", "'run_id': Input should be a valid string: put it in quotes to keep it text"),
    ("run_id=off", "put it in quotes to keep it text"),
    ("ppo=null", "section 'ppo' is empty: give it keys, or remove the line"),
    ("run_id=", "'run_id': Input should be a valid string: it was given no value (empty, or null)"),
    ("ppo.lr=", "'ppo.lr': Input should be a valid number: it was given no value"),
])
def test_set_values_read_as_written(cli, tmp_path, override, needle):
    cli("run", "--config", TINY, "--storage-root", str(tmp_path), "--set", override, needle=needle)
    assert not list(tmp_path.iterdir())


def test_set_numbers_written_in_decimal():
    assert load_config(TINY, ["seed=010"]).seed == 10  # not octal 8
    assert load_config(TINY, ["seed=1_000", "ppo.lr=1e-3"]).seed == 1000
    assert load_config(TINY, ['run_id="2026-01-01"']).run_id == "2026-01-01"


def test_config_file_numbers_written_in_decimal(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("seed: 010\nrun_id: 0755\nppo:\n  rollout_batch_size: 1_024\n")
    loaded = load_config(str(config))
    assert (loaded.seed, loaded.run_id, loaded.ppo.rollout_batch_size) == (10, "0755", 1024)  # not octal 8, 493
    for written in ("12:30", "0x1f", "0o17"):  # base 60 (750), hex, octal: refused, not read as another number
        config.write_text(f"seed: {written}\n")
        with pytest.raises(UserError, match="'seed': Input should be a valid integer"):
            load_config(str(config))
    config.write_text("ppo:\n  lr: 1:30.5\n")  # a base-60 float, 90.5
    with pytest.raises(UserError, match="'ppo.lr': Input should be a valid number"):
        load_config(str(config))


@pytest.mark.parametrize("settings, needle", [
    ({"env": {"HF_HUB_OFFLINE": 1}}, "env must map text to text, got {'HF_HUB_OFFLINE': 1}: put values"),
    ({"node_selector": {"spot": True}}, "node_selector must map text to text"),
    ({"env": {"AWS_SECRET_ACCESS_KEY": "hunter2"}}, "env: AWS_SECRET_ACCESS_KEY looks like a credential"),
    ({"env": {"1 BAD=": "x"}}, "is not an environment variable name"),
    ({"namespace": "Bad_NS!"}, "namespace 'Bad_NS!' is not a Kubernetes name"),
    ({"secrets": [{"name": "bad name", "env": {"X": "y"}}]}, "secret 'bad name' is not a Kubernetes name"),
    ({"image": ""}, "image and gpu_image must name container images"),
    ({"namespace": 5}, "namespace must be text, not 5"),
    ({"gpus_per_node": -1}, "gpus_per_node must be between 0 and 64, not -1"),  # a kfp traceback at compile
    ({"shm_gib": -5}, "shm_gib must be between 1 and 4096"), ({"retries": -1}, "retries must be between 0 and 100"),
    ({"image": "ghcr.io/rlaif/rlaif :0.1.0"}, "image 'ghcr.io/rlaif/rlaif :0.1.0' is not a container image reference"),
    ({"gpu_image": "ghcr.io/rlaif/rlaif:0.1.0 cuda"}, "gpu_image 'ghcr.io/rlaif/rlaif:0.1.0 cuda' is not a container"),
    ({"gpu_image": "ghcr.io/rlaif/rlaif::cuda"}, "is not a container image reference"),
    ({"gpu_tolerations": [{"key": "nvidia.com/gpu", "operator": "Exist"}]}, "operator 'Exist' of 'nvidia.com/gpu' "
                                                                            "must be Exists or Equal"),
    ({"gpu_tolerations": [{"key": "gpu", "effect": "NoScheduel"}]}, "effect 'NoScheduel' of 'gpu' must be one of"),
    ({"secrets": [{"name": "a", "env": {"HF_TOKEN": "t"}}, {"name": "b", "env": {"HF_TOKEN": "token"}}]},
     "secrets: HF_TOKEN is mapped by both a and b: keep one of them"),
    ({"secrets": [{"name": "s3", "env": {"AWS_ENDPOINT_URL": "url"}}], "env": {"AWS_ENDPOINT_URL": "http://minio"}},
     "env: AWS_ENDPOINT_URL is also mapped by secret s3: keep one of them"),
    ({"env": {"AWS_ACCESS_KEY_ID_FILE": "/k", "RLAIF_CLUSTER_JSON": "{}"}},
     "env: RLAIF_CLUSTER_JSON, which rlaif sets itself for the processes it starts: remove it"),
    # a shared lock owner let a second run take the first's locks; an error file hid every error from the pod log
    ({"env": {"RLAIF_LOCK_OWNER": "team"}}, "env: RLAIF_LOCK_OWNER, which rlaif sets itself"),
    ({"env": {"RLAIF_ERROR_FILE": "/tmp/e"}}, "env: RLAIF_ERROR_FILE, which rlaif sets itself"),
    ({"secrets": [{"name": "s", "env": {"RLAIF_FRESH_START": "k"}}]},
     "secrets: s maps RLAIF_FRESH_START, which rlaif sets itself"),
    # Kubernetes' grammar, which it applies only when it creates the first pod of a run (or never schedules it)
    ({"run_as_user": 0}, "run_as_user must be between 1 and"),  # runAsNonRoot pods as root never start
    ({"node_selector": {"gpu type": "a100"}}, "node_selector: 'gpu type' is not a node label key"),
    ({"gpu_node_selector": {"nvidia.com/gpu.product": "NVIDIA H100 80GB"}},
     "gpu_node_selector: 'NVIDIA H100 80GB' (for nvidia.com/gpu.product) is not a label value"),
    ({"node_selector": {"Bad_Prefix/x": "y"}}, "is not a node label key"),
    ({"node_selector": {"pool": "x" * 64}}, "is not a label value"),
    ({"gpu_resource": "gpu"}, "gpu_resource 'gpu' is not an extended resource name"),
    ({"trainjob_runtime": "Torch Distributed"}, "trainjob_runtime 'Torch Distributed' is not a Kubernetes name"),
    ({"secrets": [{"name": "s", "env": {"HF_TOKEN": "my token"}}]}, "secret s: 'my token' (for HF_TOKEN) is not a"),
    ({"secrets": [{"name": "s", "env": {"HF TOKEN": "t"}}]}, "secret s: 'HF TOKEN' is not an environment variable"),
    ({"secrets": [{"name": "", "env": {"X": "y"}}]}, "secret '' is not a Kubernetes name"),
    ({"gpu_tolerations": [{"key": "gpu", "operator": "Exists", "value": "true"}]},
     "has operator Exists and value 'true'"),
    ({"gpu_tolerations": [{"key": "", "operator": "Equal", "value": "x"}]}, "without a key tolerates every taint"),
    ({"gpu_tolerations": [{"key": "nvidia.com gpu"}]}, "key 'nvidia.com gpu' is not a taint key"),
    ({"gpu_tolerations": [{"key": 5}]}, "gpu_tolerations: key must be text, not 5"),
    ({"gpu_tolerations": [{"key": "g", "operator": "Equal", "value": "a b"}]}, "value 'a b' of 'g' is not a taint"),
])
def test_cluster_settings_kubernetes_would_refuse(settings, needle):
    with pytest.raises(ValueError) as refused:
        cluster.from_dict(settings)
    assert needle in str(refused.value)


def test_cluster_settings_that_stay_valid():
    plain = {"TOKENIZERS_PARALLELISM": "false", "AWS_ENDPOINT_URL": "http://minio:9000", "HF_TOKEN_PATH": "/t",
             "RLAIF_DECODER": "static", "RLAIF_PACKING": "off",  # the documented switches stay the user's
             "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "GOOGLE_APPLICATION_CREDENTIALS": "/var/run/key.json",
             "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token"}  # switches and paths, not credentials
    spec = cluster.from_dict({"env": plain, "namespace": "ml-team", "node_selector": {"spot": "true"},
                              "service_account": "pipeline-runner.sa",
                              "secrets": [{"name": "rlaif.judge", "env": {"RLAIF_JUDGE_API_KEY": "api_key"}}]})
    assert spec.env == plain and spec.namespace == "ml-team" and spec.secrets[0].name == "rlaif.judge"
    images = {"image": "localhost:5000/team/rlaif:0.1.0", "gpu_image": f"nvcr.io/team/rlaif@sha256:{'a' * 64}"}
    assert cluster.from_dict(images).image == images["image"]
    tolerations = [{"key": "a", "operator": "Equal", "value": "x", "effect": "NoExecute"}, {"key": "b", "effect": None},
                   {"key": "c", "effect": ""}, {"key": "d", "effect": "PreferNoSchedule"}, {"key": ""},
                   {"key": "example.com/t_1", "operator": "Equal", "value": ""}, {"operator": "Exists"},
                   {"key": "team", "value": "a"}]  # Kubernetes' default operator with a value: Equal
    parsed = cluster.from_dict({"gpu_tolerations": tolerations}).gpu_tolerations
    assert len(parsed) == 8 and parsed[-1].operator == "Equal" and parsed[1].operator == "Exists"
    assert cluster.from_dict({"secrets": None, "gpu_tolerations": None}).secrets == ()
    assert cluster.from_dict({"env": {"MY-VAR.x": "1"}}).env == {"MY-VAR.x": "1"}  # a name Kubernetes takes
    scheduling = {"node_selector": {"cloud.google.com/gke-nodepool": "gpu-pool_1", "spot": ""},
                  "gpu_node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                  "gpu_resource": "amd.com/gpu",
                  "secrets": [{"name": "s", "env": {"HF_TOKEN": "hf.token-1_a"}}], "run_as_user": 1}
    assert cluster.from_dict(scheduling).gpu_resource == "amd.com/gpu"
    with pytest.raises(ValueError, match="use_gpus must be true or false, not 'false'"):
        cluster.from_dict({"use_gpus": "false"})


def test_a_directory_two_ranks_create_is_no_wrong_kind(tmp_path):
    from rlaif.io.disk_problems import disk_problem

    (tmp_path / "made").mkdir()
    with pytest.raises(FileExistsError) as race:
        (tmp_path / "made").mkdir()
    assert disk_problem(race.value) is None  # the directory is one: a race or a bug, not the user's path


def test_unnamed_principles_that_start_alike_keep_apart(tmp_path):
    from rlaif.judges.constitution import load_constitution

    start = "Please choose the assistant response that is as "
    constitution = tmp_path / "constitution.yaml"
    constitution.write_text(f"- text: {start}harmless as possible\n- text: {start}ethical as possible\n"
                            f"- {{name: brief, text: be brief}}\n")
    names = [principle["name"] for principle in load_constitution(str(constitution))]
    assert names == [start[:40], f"{start[:40]} (2)", "brief"]


@pytest.mark.parametrize("principles, needle", [
    ("- {name: a, text: \"\\u200b\"}\n", "needs a non-empty string 'text'"),
    ("- {name: a, text: Yes}\n", "put such a text in quotes"),
    ("- {name: a, text: be kind, contrast: be kind}\n", "its 'contrast' repeats its 'text'"),
    ("- {name: a, text: be kind}\n- {name: a, text: be brief}\n", "two principles are named 'a'"),
])
def test_constitutions_without_a_signal(cli, tmp_path, principles, needle):
    constitution = tmp_path / "constitution.yaml"
    constitution.write_text(principles, encoding="utf-8")
    cli("run", "--config", TINY, "--storage-root", str(tmp_path / "root"), "--set",
        f"label.constitution={constitution}", needle=needle)
    assert not (tmp_path / "root").exists() or not list((tmp_path / "root").rglob("manifest.json"))


def test_a_prompt_of_invisible_characters_is_empty(cli, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"How do I do task {k}?"} for k in range(40)] + [{"prompt": "\u200b\u200d\ufeff"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cli("run", "--config", TINY, "--storage-root", str(tmp_path / "root"), "--set", f"data.prompts={prompts}",
        needle="line 41 has an empty prompt")


def test_variables_left_in_the_environment(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("RLAIF_ERROR_FILE", str(tmp_path / "no-such-dir/errors"))  # not a launcher's: still one line
    cli("run", "--config", TINY, "--set", "ppo=3", needle="'ppo' is a section, not a value: set its keys")
    monkeypatch.delenv("RLAIF_ERROR_FILE")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cli("stage", "generate", "--config", TINY, "--set", f"storage.root=file://{tmp_path}/root",
        needle="WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT not: run the stage under torchrun")
    assert not list((tmp_path / "root").rglob("*.tar"))


def test_the_built_in_defaults_do_not_run_in_the_demos_run_directory():
    # `rlaif run` with no --config runs the defaults: under the demo's run id it would replace the demo's outputs
    from rlaif.config import PipelineConfig

    assert PipelineConfig().run_id == "default" != load_config("configs/demo.yaml").run_id


def test_serve_flags_that_would_be_ignored(cli):
    cli("serve", "--config", TINY, "--no-ray", "--cluster", "/nowhere/cluster.yaml",
        needle="--cluster is read by --manifest only")
    cli("serve", "--config", TINY, "--no-ray", "--address", "bogus:1", needle="--address is for serving on Ray here")
    cli("serve", "--config", TINY, "--manifest", "deployment", "--address", "auto",
        needle="--address is for serving on Ray here")
    cli("serve", "--config", TINY, "--manifest", "deployment", "--no-ray", needle="drop --no-ray")


def test_sampling_temperatures_too_small_to_sample_with():
    for key in ("generate", "ppo", "evaluate", "train_rm.student"):
        with pytest.raises(UserError, match=f"'{key}.temperature': 1e-40 is too small to sample with"):
            load_config(TINY, [f"{key}.temperature=1e-40"])
    greedy = load_config(TINY, ["generate.temperature=0", "generate.identical_pairs=keep"])  # greedy, where allowed
    assert greedy.generate.temperature == 0
    with pytest.raises(UserError, match="temperature 0 is greedy: a prompt's two responses are the same"):
        load_config(TINY, ["generate.temperature=0"])  # identical_pairs resample would drop every pair
    assert load_config(TINY, ["ppo.temperature=0.001"]).ppo.temperature == 0.001
    with pytest.raises(UserError, match="'generate.temperature': 1e-06 is too small to sample with .* or 0 for greedy"):
        load_config(TINY, ["generate.temperature=1e-6"])


def test_tracker_settings_checked_before_work(cli, tmp_path):
    # each failed only once train_rm started, after generate and label (a 153-line traceback for the URI)
    root = ["--set", f"storage.root=file://{tmp_path}/root"]
    cli("run", "--config", TINY, *root, "--set", "tracking.report_to=[mlflow]", "--set",
        "tracking.mlflow_tracking_uri=localhost:5000", needle="has no scheme: write http://localhost:5000")
    cli("run", "--config", TINY, *root, "--set", "tracking.wandb_project=team/proj",
        needle="holds '/', which W&B project names cannot")
    cli("run", "--config", TINY, *root, "--set", 'tracking.mlflow_experiment=" "', needle="is blank: name it")
    assert not (tmp_path / "root" / "tiny").exists()  # no run started


@pytest.mark.parametrize("settings, needle", [
    (["ppo.rollout_batch_size=7", "ppo.minibatch_size=7"], "ppo.rollout_batch_size=7 must be divisible by 2 processes"),
    (["ppo.minibatch_size=1"], "ppo.minibatch_size=1 must be divisible by 2 processes x grad_accum_steps 1"),
    (["ppo.algorithm=grpo", "ppo.group_size=8"], "must be divisible by 2 processes x group_size 8"),
    (["train_rm.batch_size=7"], "train_rm.batch_size=7 must be divisible by processes x grad_accum_steps (2 x 1)"),
    (["train_rm.student.layers=1", "train_rm.student.batch_size=3"], "student.batch_size=3 must be divisible by the 2"),
])
def test_batch_sizes_that_do_not_split_over_the_processes_are_refused_before_work(cli, tmp_path, settings, needle,
                                                                                  monkeypatch):
    # each was refused by its stage's ranks, after generate and label (and train_rm) had run
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)  # the config's nproc 2, on a GPU machine too
    sets = [arg for setting in settings for arg in ("--set", setting)]
    cli("run", "--config", TINY, "--set", f"storage.root=file://{tmp_path}/root", *sets, needle=needle)
    assert not (tmp_path / "root" / "tiny").exists()  # no run started


def test_an_hf_judge_on_a_label_pod_sized_without_a_gpu(tmp_path, monkeypatch):
    """A pipeline compiled for a judge that runs no model gives label a CPU pod; its runtime `judge` parameter (or
    another config) set to hf would load the judge model on the pod's CPUs: launch (which the CLI, the DAGs' tasks
    and the KFP components all call) refuses before any work."""
    from rlaif.orchestration.pod import SIZED_FOR_JUDGE_ENV

    monkeypatch.setenv(SIZED_FOR_JUDGE_ENV, "rules")
    hf = load_config(TINY, [f"storage.root=file://{tmp_path}", "label.judge=hf", "label.hf.model=/models/judge"])
    with pytest.raises(UserError, match="^label's judge hf runs its model in this pod, which was sized without a GPU "
                                        "for judge 'rules': compile the pipeline for this config"):
        launch.launch(hf, "label", "unused")
    assert not list(tmp_path.iterdir())
    served = load_config(TINY, [f"storage.root=file://{tmp_path}", "label.judge=hf", "label.hf.model=/models/judge",
                                "label.hf.endpoint.base_url=http://judge:8000/v1"])
    preflight.check_label_pod(served)  # its model runs in the service: the CPU pod is right


def test_messages_that_name_the_real_fix(cli, tmp_path, monkeypatch):
    """A relative path missing when run from another directory, a config URL without its '//', and an address this
    machine does not have (the message said to pick another port)."""
    config = str(Path(TINY).resolve())
    monkeypatch.chdir(tmp_path)
    cli("run", "--config", config, "--storage-root", str(tmp_path / "root"),
        needle=f"a relative path is read from the working directory, {tmp_path}, not from the config's")
    cli("run", "--config", "file:configs/tiny.yaml", needle="looks like a URL without its '//'")
    cli("serve", "--config", config, "--no-ray", "--set", "serve.host=192.0.2.1",
        needle="serve.host=192.0.2.1 is not an address of this machine")


def test_a_comparison_read_through_a_closed_pipe_is_still_written(tmp_path):
    """`rlaif report A B --output c.html | head -1`: the table was printed before the page was written, so a reader
    that left early cost the page, and the command exited 2."""
    for name in ("a", "b"):
        (tmp_path / name / "evaluate").mkdir(parents=True)
        judge = {"judge": "embedding", "win_rate": 0.6, "win_rate_ci95": [0.5, 0.7], "wins": 6, "ties": 0, "losses": 4}
        (tmp_path / name / "evaluate/metrics.json").write_text(json.dumps({
            "n_prompts": 10, "win_rate": 0.6, "win_rate_ci95": [0.5, 0.7], "win_rate_length_controlled": 0.6,
            "wins": 6, "ties": 0, "losses": 4, "judges": {"training": judge}, "gates": {"checked": False}}))
    page = tmp_path / "c.html"
    proc = subprocess.Popen([sys.executable, "-m", "rlaif", "report", str(tmp_path / "a"), str(tmp_path / "b"),
                             "--output", str(page)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "Traceback" not in err, err
    assert "<table>" in page.read_text()

"""Every input checked before work starts (issue 18's classes): numeric ranges and cross-field rules in the config
schema, YAML that is not a config, paths that are not regular files, prompt files and ids, secrets in URLs, manifests,
lock files and output paths that cannot be trusted. Each: exit 2, one line naming the problem, nothing written."""
import json
import os

import pytest

from rlaif.config import load_config
from rlaif.io import manifest as manifests
from rlaif.stages.common import context

SECRET = "hunter2-s3cr3t"  # the conftest fixture asserts it is never echoed

TINY = "configs/tiny.yaml"


def nothing_written(root) -> bool:
    return not root.exists() or not list(root.rglob("manifest.json"))


@pytest.mark.parametrize("override, needle", [
    ("ppo.lr=0", "'ppo.lr'"), ("ppo.lr=.nan", "'ppo.lr'"), ("train_rm.lr=-1e-4", "'train_rm.lr'"),
    ("policy.tiny.sft_lr=.inf", "'policy.tiny.sft_lr'"), ("ppo.iterations=0", "'ppo.iterations'"),
    ("train_rm.epochs=0", "'train_rm.epochs'"), ("generate.batch_size=0", "'generate.batch_size'"),
    ("generate.max_new_tokens=0", "'generate.max_new_tokens'"),
    ("evaluate.max_new_tokens=-3", "'evaluate.max_new_tokens'"),
    ("generate.temperature=-0.1", "'generate.temperature'"), ("evaluate.temperature=0", "'evaluate.temperature'"),
    ("ppo.temperature=.inf", "'ppo.temperature'"),
    ("generate.top_p=0", "'generate.top_p'"), ("generate.top_p=1.5", "'generate.top_p'"),
    ("evaluate.tie_margin=0.5", "'evaluate.tie_margin'"),
    ("train_rm.held_out_fraction=1", "'train_rm.held_out_fraction'"),
    ("train_rm.warmup_fraction=1", "'train_rm.warmup_fraction'"), ("seed=-1", "'seed'"),
    ("seed=99999999999999999999999", "'seed'"), ("seed=4294967296", "'seed'"),
    ("ppo.minibatch_size=3", "minibatch_size 3 must divide"),
    ("ppo.gamma=0", "'ppo.gamma'"), ("label.batch_size=0", "'label.batch_size'"),
    ("generate.shard_size=0", "'generate.shard_size'"),
    ("policy.tiny.num_heads=3", "must be a multiple of num_heads"),
    ("policy.prompt_template=Q: {question}", "'policy.prompt_template'"),
    ("policy.prompt_template=no placeholder", "must contain the placeholder"),
    ("policy.prompt_template={prompt} }", "'policy.prompt_template'"),
    ("policy.prompt_template={prompt.upper}", "'policy.prompt_template'"),
    ("policy.prompt_template={prompt[a]}", "'policy.prompt_template'"),
    ("evaluate.judges=[{name: reference}]", "the name 'reference' is the reference judge's"),
    ("label.rules.pattern=(", "not a valid regular expression"),
    ("label.rules.pattern=x*", "matches the empty string"), ("label.rules.pattern=''", "matches the empty string"),
    ("label.rules={min_words: 10, max_words: 5}", "min_words=10 is above max_words=5"),
    ("run_id=..", "'run_id'"), ("run_id=.", "'run_id'"), ("run_id=a/b", "'run_id'"), ("run_id=", "'run_id'"),
    ("run_id=" + "x" * 129, "'run_id'"), ("run_id=tab\there", "'run_id'"),
    ("storage.root=s3://", "needs a bucket"), ("storage.root=s3:///prefix", "needs a bucket"),
    ("storage.root=file://", "has no path"),
    ("evaluate.judges=[{name: x, judge: rules", "read as text, not as a YAML list or mapping"),
    (f"storage.root=s3://user:{SECRET}@bucket/x", "must not contain a user name or password"),
    (f"label.openai.base_url=http://u:{SECRET}@judge:8000/v1", "must not contain a user name or password"),
    ("evaluate.judges=[{name: training}]", "the name 'training' is the label stage's judge"),
    ("evaluate.judges=[{name: a}, {name: a}]", "judge names must be unique"),
    ("evaluate.judges=[{name: copy, constitution: data/constitution.yaml}]",  # the tiny config's label judge again
     "error: evaluate.judges[copy] has the training judge's settings"),
    ("evaluate.judges=[{name: 'bad name'}]", "'evaluate.judges.0.name': 'bad name' is not letters, digits"),
    ("serve.name=My_Service", "'serve.name': 'My_Service' is not a Kubernetes Service name: lowercase letters"),
    ("serve.route_prefix=/a/b", "'/a/b' is not / or one path segment"),
    ("label.openai.api_key_env=", "write one (for empty text: ''), or leave the key out"),
    ("label.reference.min_point_overlap=0", "'label.reference.min_point_overlap'"),
    # Finite in Python, not in the float32 training computes in: infinite there (NaN losses), or 0 (no training).
    ("ppo.kl_coef=1e39", "'ppo.kl_coef'"),
    ("ppo.missing_eos_penalty=1e308", "'ppo.missing_eos_penalty'"), ("ppo.lr=1e-300", "float32 (in which it is "
                                                                   "computed) rounds to 0: give a larger value"),
    ("ppo.value_clip=1e39", "'ppo.value_clip'"),
    # Too large to be meant: one sampled a hundred quintillion responses per prompt until the OOM killer came.
    ("generate.samples_per_prompt=100000000000000000000", "'generate.samples_per_prompt'"),
    ("ppo.iterations=100000000000000000000", "'ppo.iterations'"),
    ("generate.top_k=100000000000000000000", "'generate.top_k'"),
    # A lone surrogate passes as a str until a stage encodes it (its config dump died with a traceback).
    ("policy.prompt_template=Q: {prompt} \udcff", "'policy.prompt_template': holds a lone surrogate"),
    ('generate.stop=["\\udcff"]', "'generate.stop': holds a lone surrogate"),
])
def test_config_ranges_and_rules(cli, tmp_path, override, needle):
    key, _, value = override.partition("=")
    where = (["--storage-root", value] if key == "storage.root"
             else ["--storage-root", f"file://{tmp_path}/root", "--set", override])
    cli("run", "--config", TINY, *where, needle=needle)
    assert not (tmp_path / "root").exists()


def numeric_fields(model, prefix=""):
    """(dotted name, field) of every int or float setting (alone or with None) in the config schema."""
    from rlaif.config.base import _numeric

    for name, field in model.model_fields.items():
        if hasattr(field.annotation, "model_fields"):
            yield from numeric_fields(field.annotation, f"{prefix}{name}.")
        elif _numeric(field.annotation):
            yield prefix + name, field


def test_every_numeric_setting_has_a_range_both_ways():
    """A bound below and above on every number (TRL's config dataclasses): a value too large to be meant is refused
    at once, not met as an out-of-memory kill or an overflow mid-run. eval_fraction's validator holds it in (0, 1)."""
    import annotated_types

    from rlaif.config import PipelineConfig

    def bounded(field, kinds) -> bool:
        return any(isinstance(m, kinds) for m in field.metadata)

    fields = dict(numeric_fields(PipelineConfig))
    assert len(fields) > 80 and "ppo.iterations" in fields and "label.hf.max_length" in fields
    unbounded = [name for name, field in fields.items() if name != "data.eval_fraction" and not (
        bounded(field, (annotated_types.Ge, annotated_types.Gt))
        and bounded(field, (annotated_types.Le, annotated_types.Lt)))]
    assert unbounded == []


def test_launch_time_checks(cli, tmp_path, monkeypatch):
    root = ("--storage-root", f"file://{tmp_path}/root")
    monkeypatch.delenv("RLAIF_JUDGE_API_KEY", raising=False)
    cli("run", "--config", TINY, *root, "--set", "label.judge=openai", "--set", "label.openai.base_url=http://127.0.0.1:9/v1",
        "--set", "label.openai.model=m", needle="$RLAIF_JUDGE_API_KEY is not set")
    cli("run", "--config", TINY, *root, "--set", "label.judge=hf", "--set", f"label.hf.model={tmp_path}",
        "--set", f"label.few_shot={tmp_path}/missing.jsonl", needle="few-shot file not found")
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "How do I bake bread?", "key_points": ["mix flour"]}\n'
                     '{"prompt": "How do I cook rice?"}\n')
    cli("run", "--config", TINY, *root, "--set", f"data.prompts={plain}", "--set", "label.judge=reference",
        needle="needs key points on every prompt; 1 of 2")
    assert nothing_written(tmp_path / "root")


def test_valid_inputs_that_look_odd_are_accepted(cli, tmp_path):
    """YAML anchors and merge keys, a numeric-looking run id: accepted (the launch then stops at the missing input)."""
    config = tmp_path / "c.yaml"
    config.write_text("ppo: &ppo {rollout_batch_size: 8, minibatch_size: 4}\nevaluate: {n_prompts: 16}\n"
                      "generate:\n  <<: {max_prompts: 32}\n  max_new_tokens: 12\n")
    cli("launch", "label", "--config", str(config), "--storage-root", f"file://{tmp_path}/root", "--run-id", "20240101",
        needle="root/20240101/generate/manifest.json does not exist")


def test_config_files_that_are_not_configs(cli, tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("ppo:\n  lr: 0.1\n  lr: 0.2\n")
    cli("run", "--config", str(bad), needle="duplicate key 'lr'")
    bad.write_text("ppo: " + "[" * 20000 + "]" * 20000 + "\n")
    cli("run", "--config", str(bad), needle="config file")
    bad.write_bytes(b"ppo:\n  lr: \xff\xfe\n")
    cli("run", "--config", str(bad), needle="is not UTF-8")
    cli("run", "--config", str(tmp_path), needle="is not a regular file")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    cli("run", "--config", str(fifo), needle="is not a regular file")  # at once: a FIFO is never opened
    bad.write_text("label:\n  judge: rules\n  rules: {pattern: '['}\n")
    cli("run", "--config", str(bad), needle="label.rules.pattern")


@pytest.mark.parametrize("content, needle", [
    (b'{"id": "a.b", "prompt": "x"}\n', "id 'a.b' is not usable"),
    (b'{"id": "", "prompt": "x"}\n', "id '' is not usable"),
    (b'{"id": "../up", "prompt": "x"}\n', "is not usable"),
    (b'{"id": 1.5, "prompt": "x"}\n', "is not usable"),
    (b'{"id": true, "prompt": "x"}\n', "is not usable"),
    (b'{"prompt": "   "}\n', "has an empty prompt"),
    (b'{"prompt": "x", "key_points": "one"}\n', "'key_points' must be a non-empty list of non-empty strings"),
    (b'{"prompt": "x", "key_points": ["a", 3]}\n', "'key_points' must be a non-empty list"),
    (b'{"prompt": "x", "reference": ["a"]}\n', "'reference' must be a non-empty string"),
    (b'[1, 2]\n', "line 1 is a JSON array, not an object with a 'prompt' field"),
])
def test_prompt_files(cli, tmp_path, content, needle):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    cli("run", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", "--set", f"data.prompts={path}",
        needle=needle)
    assert nothing_written(tmp_path / "root")


def test_prompt_paths_that_are_not_files(cli, tmp_path):
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "a-directory").mkdir()  # one holding data files is named as such (test_prompt_formats)
    for path in (fifo, tmp_path / "a-directory"):
        cli("run", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", "--set", f"data.prompts={path}",
            needle="is not a regular file")
    constitution = tmp_path / "constitution.yaml"
    constitution.write_text("- {name: a, text: 3}\n")
    cli("run", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", "--set",
        f"label.constitution={constitution}", needle="needs a non-empty string 'text'")
    constitution.write_text("- {name: a, text: x}\n- {name: a, text: y, name: b}\n")
    cli("run", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", "--set",
        f"label.constitution={constitution}", needle="duplicate key 'name'")


def _generate_manifest(tmp_path, **change):
    """A committed generate manifest, then tampered with: `change` replaces top-level fields or the first shard."""
    from rlaif.io.shards import ShardWriter

    url = f"file://{tmp_path}/tiny/generate"
    with ShardWriter(url, 5) as writer:
        writer.write({"__key__": "p0", "prompt.txt": "q", "response_a.txt": "a", "response_b.txt": "b"})
    cfg = load_config(TINY, [f"storage.root=file://{tmp_path}", "label.judge=rules"])  # the label command's below
    written = manifests.write(url, stage="generate", run_id="tiny", config_hash=context(cfg, "generate").config_hash,
                              inputs={}, shards=writer.shards)
    path = tmp_path / "tiny/generate/manifest.json"
    if "raw" in change:
        path.write_bytes(change["raw"])
        return
    written.update({k: v for k, v in change.items() if k != "shard_url"})
    if "shard_url" in change:
        written["shards"][0]["url"] = change["shard_url"]
    path.write_text(json.dumps(written))


@pytest.mark.parametrize("change, needle", [
    ({"shard_url": "../../../etc/passwd"}, "lists a shard outside its stage directory"),
    ({"shard_url": "/etc/passwd"}, "lists a shard outside its stage directory"),
    ({"shard_url": "s3://other-bucket/shard-000000.tar"}, "lists a shard outside its stage directory"),
    ({"files": [{"path": "../label/manifest.json"}]}, "lists a file outside its stage directory"),
    ({"raw": b"[1, 2, 3]"}, "is not a manifest"),
    ({"raw": b"\x00\x01binary\xff"}, "is not valid JSON"),
    ({"shards": "not a list"}, "missing or has malformed fields (shards)"),
    ({"num_samples": "many"}, "missing or has malformed fields (num_samples)"),
])
def test_manifests_that_cannot_be_trusted(cli, tmp_path, change, needle):
    _generate_manifest(tmp_path, **change)
    cli("stage", "label", "--config", TINY, "--set", f"storage.root=file://{tmp_path}", "--set", "label.judge=rules",
        needle=needle)
    assert not (tmp_path / "tiny/label/manifest.json").exists()


def test_corrupt_lock_file(cli, tmp_path):
    lock = tmp_path / "root/tiny/generate/.lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"\x00not a lock")
    cli("launch", "generate", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", needle="is corrupt")
    assert nothing_written(tmp_path / "root")


def test_output_paths_and_endpoints(cli, tmp_path):
    cli("compile", "kfp", "--output", str(tmp_path / "missing-dir/p.yaml"), needle="does not exist")
    cli("compile", "kfp", "--output", str(tmp_path), needle="name the pipeline YAML file")
    cli("submit", "kfp", "--endpoint", f"http://user:{SECRET}@127.0.0.1:9", "--config", TINY, "--storage-root",
        "s3://bucket/r", needle="KFP endpoint http://***@127.0.0.1:9 cannot be reached")
    cli("report", str(tmp_path / "no-run"), needle="not found")
    from rlaif.io.lock import StageLock

    for held, what in (("running/evaluate", "stage 'evaluate'"), ("running", "`rlaif run`")):  # --rerun evaluate,
        with StageLock(f"file://{tmp_path}/{held}", what):  # or a run at an earlier stage
            line = cli("report", str(tmp_path / "running"), needle=f"run file://{tmp_path}/running is running now")
            assert line.endswith(f"({what}), its evaluation not written yet: run `rlaif report` again when it has "
                                 "finished")
    metrics = tmp_path / "run/evaluate/metrics.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_bytes(b"\x00{not json")
    cli("report", str(tmp_path / "run"), needle="is corrupt")
    metrics.write_text("[1, 2]")
    cli("report", str(tmp_path / "run"), needle="is not an evaluation's metrics")
    cli("report", str(tmp_path / "run"), str(tmp_path / "other"), "--output", str(tmp_path),
        needle="name the comparison HTML file")
    cli("report", str(tmp_path / "run"), f"file://{tmp_path}/run/", needle="is given twice: name each run")
    cli("report", str(tmp_path / "other"), str(tmp_path / "run"), "--output", str(tmp_path / "run/evaluate/c.html"),
        needle=f"is inside run file://{tmp_path}/run, whose files are its own")
    cli("run", "--config", TINY, "--storage-root", "s3://bucket/x", "--set", "storage.endpoint_url=http://127.0.0.1:9",
        needle="is not writable")


HEADER = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
WEIGHTS = len(HEADER).to_bytes(8, "little") + HEADER + b"\0" * 8
BAD_OFFSETS = len(b'{"w": {"data_offsets": []}}').to_bytes(8, "little") + b'{"w": {"data_offsets": []}}'
TOKENIZERS = {"no-tokenizer": None, "tokenizer-cut-short": '{"model": {"vocab": {"a'}


def _model_dir(path, config=b"{}", weights=None, tokenizer="{}"):
    path.mkdir()
    (path / "config.json").write_bytes(config)
    (path / "model.safetensors").write_bytes(weights if weights is not None else WEIGHTS)
    if tokenizer is not None:
        (path / "tokenizer.json").write_text(tokenizer)
    return path


@pytest.mark.parametrize("key, kind, needle", [
    ("policy.model", "config-not-object", "config.json is not a JSON object"),
    ("policy.model", "bad-header", "are not valid safetensors (a bad header"),
    ("policy.model", "data-cut-short", "are not valid safetensors"),
    ("policy.model", "offsets-not-a-pair", "are not valid safetensors"),
    ("policy.model", "tokenizer-cut-short", "tokenizer.json is not a JSON object (truncated?)"),
    ("train_rm.backbone", "no-tokenizer", "has no tokenizer files"),
    ("train_rm.backbone", "truncated", "are not valid safetensors"),
])
def test_model_directories_checked_at_launch(cli, tmp_path, key, kind, needle):
    model = _model_dir(tmp_path / "model", config=b"[1, 2]" if kind == "config-not-object" else b"{}",
                       weights={"bad-header": b"\xff" * 16, "truncated": b"\x10\x00",
                                "data-cut-short": WEIGHTS[:-3], "offsets-not-a-pair": BAD_OFFSETS}.get(kind),
                       tokenizer=TOKENIZERS.get(kind, "{}"))
    cli("run", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", "--set", f"{key}={model}", needle=needle)
    assert nothing_written(tmp_path / "root")


def test_unwritable_model_cache(cli, tmp_path, monkeypatch):
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("RLAIF_CACHE", str(blocker))
    cli("run", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", needle="is not writable")


def test_prompt_datasets(cli, tmp_path):
    """Parquet prompts and datasets' data files through the CLI: a missing column or an unknown data.columns key is one
    line (no datasets progress bar) before any work; mapped columns get through the launch checks."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"question": ["How do I bake bread?", "How do I cook rice?"]}), tmp_path / "p.parquet")
    root = ("--storage-root", f"file://{tmp_path}/root")
    cli("run", "--config", TINY, *root, "--set", f"data.prompts={tmp_path}/p.parquet",
        needle="has no column 'prompt' (it has 'question'): set data.columns.prompt")
    cli("run", "--config", TINY, *root, "--set", f"data.prompts={tmp_path}/*.parquet", "--set", "data.format=hf",
        needle="set data.columns.prompt")
    cli("run", "--config", TINY, *root, "--set", f"data.prompts={tmp_path}/p.parquet", "--set",
        "data.columns.promt=question", needle="did you mean 'data.columns.prompt'")
    assert nothing_written(tmp_path / "root")
    cli("launch", "label", "--config", TINY, *root, "--set", f"data.prompts={tmp_path}/p.parquet", "--set",
        "data.columns.prompt=question", needle="generate/manifest.json does not exist")


def test_an_adaptive_kl_target_under_grpo_is_refused():
    """GRPO's KL loss weight is fixed: an adaptive target would only switch the reference pass on, unread."""
    from rlaif.errors import UserError

    with pytest.raises(UserError, match="adaptive_kl_target adapts PPO's KL penalty"):
        load_config("configs/tiny.yaml", ["ppo.algorithm=grpo", "ppo.adaptive_kl_target=6"])
    # The controller scales the coefficient: from 0 it stayed 0, a reference pass ran every iteration for nothing.
    with pytest.raises(UserError, match="from 0 it stays 0: set kl_coef above 0 as its start"):
        load_config("configs/tiny.yaml", ["ppo.kl_coef=0", "ppo.adaptive_kl_target=0.1"])
    # The KL check runs between epochs: with one epoch it could never stop anything.
    with pytest.raises(UserError, match="with ppo_epochs 1 none remain: set ppo_epochs 2 or more"):
        load_config("configs/tiny.yaml", ["ppo.target_kl=0.1", "ppo.ppo_epochs=1"])
    assert load_config("configs/tiny.yaml", ["ppo.target_kl=0.1", "ppo.ppo_epochs=2"]).ppo.target_kl == 0.1


def test_a_model_cache_is_checked_writable_only_where_something_will_be_written_to_it(monkeypatch, tmp_path):
    """A read-only cache that holds the built-in policy already (an image's layer, a mount prepared once) serves it;
    one that would have to build it, or download an s3:// model, is refused before any work."""
    from rlaif.models import tiny
    from rlaif.orchestration import preflight

    checks = []
    monkeypatch.setattr(preflight, "check_model_cache_writable", lambda: checks.append("cache"))
    monkeypatch.setenv("RLAIF_CACHE", str(tmp_path / "cache"))
    cfg = load_config(TINY, ["label.judge=rules"])
    preflight.check_models(cfg)
    assert checks == ["cache"]  # nothing built in this cache yet
    in_cache = tiny.tiny_policy_dir(cfg.policy)
    monkeypatch.setattr(tiny, "built", lambda target: target == in_cache)
    preflight.check_models(cfg)
    assert checks == ["cache"]
    preflight.check_models(load_config(TINY, ["label.judge=rules", "policy.tiny.hidden_size=32"]))
    assert checks == ["cache", "cache"]  # another tiny policy: built here first
    preflight.check_models(load_config(TINY, ["label.judge=rules", "storage.root=s3://bucket/runs"]))
    assert checks == ["cache", "cache", "cache"]  # the stages download each other's models from S3 into it

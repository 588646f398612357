"""The cache key covers input content: each file a stage reads, edited in place under the same path, changes the key
of exactly the stages that read it (their downstream re-runs through the changed upstream manifest digest), and the
code digest follows the source, not the package version."""
import shutil
from pathlib import Path

import pytest

from rlaif.config import load_config, stage_config_hash
from rlaif.errors import UserError
from rlaif.graph import STAGES
from rlaif.io import digest
from rlaif.stages.common import file_digests

REPO_FILES = {"prompts": "data/prompts.jsonl", "constitution": "data/constitution.yaml",
              "heldout": "data/constitution_heldout.yaml", "demonstrations": "data/demonstrations.jsonl"}


@pytest.fixture
def copies(tmp_path):
    out = {}
    for role, path in REPO_FILES.items():
        out[role] = tmp_path / path.rsplit("/", 1)[1]
        shutil.copy(path, out[role])
    few_shot = tmp_path / "shots.jsonl"
    few_shot.write_text('{"prompt": "q", "response_1": "a", "response_2": "b", "preferred": 1}\n')
    out["few_shot"] = few_shot
    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text("{}")
    (judge / "model.safetensors").write_bytes(b"weights")
    out["judge"] = judge
    return out


def keys(copies) -> dict[str, str]:
    cfg = load_config("configs/demo.yaml", [
        f"data.prompts={copies['prompts']}", f"label.constitution={copies['constitution']}",
        f"policy.tiny.demonstrations={copies['demonstrations']}",
        f"evaluate.judges=[{{name: heldout, judge: hf, hf: {{model: {copies['judge']}}}, "
        f"constitution: {copies['heldout']}, few_shot: {copies['few_shot']}}}]"])
    return {s.name: stage_config_hash(cfg, s.config_sections, file_digests(cfg, s.name)) for s in STAGES}


@pytest.mark.parametrize("role, edit, readers", [
    ("prompts", lambda p: p.write_text(p.read_text().replace("How do I", "How can I", 1)),
     {"generate", "label", "train_rm", "ppo", "evaluate"}),
    ("constitution", lambda p: p.write_text(p.read_text().replace("polite", "rude")), {"label", "evaluate"}),
    ("heldout", lambda p: p.write_text(p.read_text().replace("warm", "cold")), {"evaluate"}),
    ("demonstrations", lambda p: p.write_text(p.read_text().replace("Sure!", "Sure.", 1)),
     {"generate", "ppo", "evaluate"}),
    ("few_shot", lambda p: p.write_text(p.read_text().replace('"a"', '"c"')), {"evaluate"}),
    ("judge", lambda p: (p / "config.json").write_text('{"hidden_size": 8}'), {"evaluate"}),
    ("judge", lambda p: (p / "model.safetensors").write_bytes(b"other weights"), {"evaluate"}),
])
def test_an_input_edited_in_place_changes_exactly_its_readers_keys(copies, role, edit, readers):
    before = keys(copies)
    edit(copies[role])
    after = keys(copies)
    assert {name for name in before if before[name] != after[name]} == readers


def test_code_digest_follows_the_source(tmp_path, monkeypatch):
    first = digest.code_digest()
    assert first == digest.code_digest() and len(first) == 64
    package = tmp_path / "rlaif"
    shutil.copytree(digest.Path(digest.rlaif.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(digest.rlaif, "__file__", str(package / "__init__.py"))
    digest.code_digest.cache_clear()
    assert digest.code_digest() == first
    (package / "algo" / "ppo.py").write_text((package / "algo" / "ppo.py").read_text() + "\n# edited\n")
    digest.code_digest.cache_clear()
    second = digest.code_digest()
    assert second != first
    kernels = package / "models" / "cpu_kernels.c"  # the C the stages compile and run is source too
    kernels.write_text(kernels.read_text() + "\n/* edited */\n")
    digest.code_digest.cache_clear()
    assert digest.code_digest() not in (first, second)
    digest.code_digest.cache_clear()


def test_large_files_and_remote_specs():
    assert digest.spec_digest("builtin:minilm").startswith("builtin:minilm:")
    assert digest.spec_digest("/nonexistent/path") == "missing"


def test_runtime_fields_are_left_out_of_the_cache_key_at_any_depth():
    from rlaif.config import Strict, cache_key_dump, runtime_field

    class Inner(Strict):
        where: str = runtime_field("a")
        what: int = 1

    class Outer(Strict):
        inner: Inner = Inner()
        items: list[Inner] = [Inner()]
        stream: bool = runtime_field(False)

    dumped = cache_key_dump(Outer(inner=Inner(where="b", what=2), stream=True))
    assert dumped == {"inner": {"what": 2}, "items": [{"what": 1}]}


def stage_keys(*overrides: str) -> dict[str, str]:
    cfg = load_config("configs/tiny.yaml", list(overrides))
    return {s.name: stage_config_hash(cfg, s.config_sections, {}) for s in STAGES}


@pytest.mark.parametrize("override", [
    "train_rm.checkpoint_every=3", "train_rm.keep_checkpoints=5", "ppo.checkpoint_every=3", "ppo.keep_checkpoints=5",
    "generate.shard_size=3", "label.shard_size=3", "train_rm.student.lr=1e-3",  # no student (layers 0): unused
])
def test_settings_of_how_a_stage_runs_leave_every_key_alone(override):
    assert stage_keys(override) == stage_keys()


@pytest.mark.parametrize("override", ["label.openai.concurrency=4", "label.openai.timeout_s=30",
                                      "label.openai.max_retries=0", "label.openai.backoff_s=0.1",
                                      "label.openai.api_key_env=OTHER_KEY"])
def test_how_an_endpoint_judge_is_called_leaves_every_key_alone(override):
    # concurrency 16 -> 4 re-judged every pair through a (paid) endpoint and re-ran everything downstream, for
    # byte-identical shards (probe 46); the endpoint and its model stay keyed.
    judged = ["label.judge=openai", "label.openai.base_url=http://judge:8000/v1", "label.openai.model=m"]
    assert stage_keys(*judged, override) == stage_keys(*judged)
    assert stage_keys(*judged, "label.openai.model=other")["label"] != stage_keys(*judged)["label"]
    assert stage_keys(*judged, "label.batch_size=7") == stage_keys(*judged)  # each comparison sent alone
    assert stage_keys("label.batch_size=7")["label"] != stage_keys()["label"]  # the embedding judge pads batches


@pytest.mark.parametrize("overrides, changed", [
    (["evaluate.batch_size=7"], {"evaluate"}),  # a seed per micro-batch
    (["ppo.nproc=3"], {"ppo"}),  # a seed per rank's slice of the rollout
    (["train_rm.nproc=3"], {"train_rm"}),  # a dropout mask per rank
    (["generate.batch_size=7"], {"generate"}),  # padding moves logits in their last bits
    (["train_rm.student.layers=2", "train_rm.student.lr=1e-3"], {"train_rm"}),  # a student: its settings count
])
def test_settings_that_change_the_samples_change_the_keys(overrides, changed):
    """The stage's own key (downstream keys follow through its manifest digest, not compared here)."""
    base, keyed = stage_keys(*overrides[:-1]), stage_keys(*overrides)
    assert {name for name in base if base[name] != keyed[name]} == changed


def test_computing_switches_in_the_environment_are_keyed(monkeypatch):
    base = stage_keys()
    monkeypatch.setenv("RLAIF_DECODER", "auto")  # the default, spelled out
    monkeypatch.setenv("RLAIF_PACKING", "on")
    assert stage_keys() == base
    monkeypatch.setenv("RLAIF_DECODER", "generate")  # another sampler: other samples, where a stage samples
    assert {name for name, key in stage_keys().items() if key != base[name]} == {"generate", "train_rm", "ppo",
                                                                                "evaluate"}
    monkeypatch.delenv("RLAIF_DECODER")
    monkeypatch.setenv("RLAIF_PACKING", "off")  # padded forwards: the stages that pack
    assert {name for name, key in stage_keys().items() if key != base[name]} == {"train_rm", "ppo", "evaluate"}
    monkeypatch.delenv("RLAIF_PACKING")
    monkeypatch.setenv("RLAIF_CPU_KERNELS", "off")  # the models' own layers: the stages that fuse them
    assert {name for name, key in stage_keys().items() if key != base[name]} == {"train_rm", "ppo", "evaluate"}


def test_an_upstream_reached_by_two_paths_is_hashed_once(tmp_path, monkeypatch):
    # evaluate reads train_rm directly and through ppo: checking that each upstream output was made from this config
    # hashes every stage's inputs once per call, not once per path (each hash reads its files and lists model dirs).
    from rlaif.graph import topological_order
    from rlaif.io import manifest
    from rlaif.stages import common

    cfg = load_config("configs/demo.yaml", [f"storage.root={tmp_path}", "run_id=paths"])
    for stage in topological_order():  # each output committed as this config would make it
        manifest.write(common.stage_url(cfg, stage.name), stage=stage.name, run_id=cfg.run_id,
                       config_hash=common.context(cfg, stage.name).config_hash, inputs={}, shards=[])
    hashed = []
    real = common.file_digests
    monkeypatch.setattr(common, "file_digests", lambda config, name: hashed.append(name) or real(config, name))
    common.context(cfg, "evaluate")
    assert sorted(hashed) == sorted(s.name for s in STAGES)
    manifest.write(common.stage_url(cfg, "label"), stage="label", run_id=cfg.run_id, config_hash="other settings",
                   inputs={}, shards=[])
    with pytest.raises(UserError, match=r"stage 'evaluate' depends on 'label' \(through 'train_rm'\), whose output "
                                        "in run 'paths' was made"):
        common.context(cfg, "evaluate")
    with pytest.raises(UserError, match="stage 'train_rm' reads 'label', whose output in run 'paths' was made"):
        common.context(cfg, "train_rm")


def test_the_tiny_policy_is_built_again_when_its_build_code_changes(tmp_path, monkeypatch):
    # keyed by the package version before: an edit of the build reran generate (its key covers the code) on the old
    # cached policy
    import rlaif.models.tiny as tiny
    from rlaif.config import load_config

    policy = load_config("configs/tiny.yaml").policy
    before = tiny.tiny_policy_dir(policy)
    edited = tmp_path / "tiny.py"
    edited.write_text(open(tiny.__file__).read() + "\n# a change to the build\n")
    monkeypatch.setattr(tiny, "__file__", str(edited))
    assert tiny.tiny_policy_dir(policy) != before


def _stage_key(overrides: list[str], stage: str) -> str:
    cfg = load_config("configs/demo.yaml", overrides)
    sections = next(s.config_sections for s in STAGES if s.name == stage)
    return stage_config_hash(cfg, sections, {})


@pytest.mark.parametrize("stage, setting, base, other", [
    ("ppo", "ppo.vf_coef=0.5", ["ppo.algorithm=grpo"], ["ppo.algorithm=ppo"]),
    ("ppo", "ppo.lam=1.0", ["ppo.algorithm=grpo"], ["ppo.algorithm=ppo"]),
    ("ppo", "ppo.value_clip=0.5", ["ppo.algorithm=grpo"], ["ppo.algorithm=ppo"]),
    ("ppo", "ppo.group_size=8", ["ppo.algorithm=ppo"], ["ppo.algorithm=grpo"]),
    ("ppo", "ppo.lora_alpha=64", ["ppo.lora_rank=0"], ["ppo.lora_rank=8"]),
    ("ppo", "ppo.zero_stage=3", ["ppo.strategy=ddp"], ["ppo.strategy=deepspeed"]),
    ("ppo", "ppo.kl_estimator=k3", ["ppo.kl_coef=0"], ["ppo.kl_coef=0.05"]),
    ("ppo", "ppo.adaptive_kl_horizon=500", ["ppo.algorithm=ppo"], ["ppo.adaptive_kl_target=6"]),
    ("ppo", "ppo.reward_inputs=text", ["ppo.reward=judge", "label.judge=rules"], ["ppo.reward=reward_model"]),
    ("train_rm", "train_rm.lora_alpha=64", ["train_rm.lora_rank=0"], ["train_rm.lora_rank=8"]),
    ("train_rm", "train_rm.data_workers=2", ["train_rm.data_split=batch"], ["train_rm.data_split=shard"]),
    ("label", "label.hf.max_length=512", ["label.judge=embedding"], ["label.judge=hf", "label.hf.model=/judge"]),
    ("label", "label.openai.model=m", ["label.judge=rules"], ["label.judge=openai", "label.openai.base_url=http://x"]),
    ("label", "label.rules.min_words=3", ["label.judge=embedding"], ["label.judge=rules"]),
    ("label", "label.relevance_weight=1", ["label.judge=rules"], ["label.judge=embedding"]),
    ("label", "label.temperature=1", ["label.judge=hf", "label.hf.model=/judge"],
     ["label.judge=hf", "label.hf.model=/judge", "label.mode=score"]),
    ("label", "label.temperature=1", ["label.judge=openai", "label.openai.base_url=http://x", "label.openai.model=m"],
     ["label.judge=embedding"]),
    ("evaluate", "label.hf.max_length=512", ["label.judge=embedding"], ["label.judge=hf", "label.hf.model=/judge"]),
])
def test_a_setting_the_chosen_options_never_read_leaves_the_key_alone(stage, setting, base, other):
    """Where the options read it, the same setting changes the key (the view drops nothing it should keep)."""
    assert _stage_key(base, stage) == _stage_key([*base, setting], stage)
    assert _stage_key(other, stage) != _stage_key([*other, setting], stage)


@pytest.mark.parametrize("judge, setting, read", [
    ("judge: reference", "constitution: /c.yaml, principles: all", False),
    ("judge: rules", "constitution: /c.yaml, principles: all", True),
    ("judge: rules", "reference: {rude_penalty: 2}", False),
    ("judge: reference", "reference: {rude_penalty: 2}", True),
    ("judge: hf, hf: {model: /judge}", "temperature: 1", False),
    ("judge: embedding", "temperature: 1", True),
])
def test_an_evaluation_judge_keys_only_the_settings_it_reads(judge, setting, read):
    plain, tuned = (f"evaluate.judges=[{{name: held, {judge}{extra}}}]" for extra in ("", ", " + setting))
    assert (_stage_key([plain], "evaluate") != _stage_key([tuned], "evaluate")) is read


def test_labels_reference_settings_stay_keyed_whatever_the_judge():
    """label grades against references whatever its judge, and evaluate's added reference judge reads them too."""
    for stage in ("label", "evaluate"):
        assert _stage_key(["label.judge=rules"], stage) != _stage_key(
            ["label.judge=rules", "label.reference.rude_penalty=2"], stage)


def test_an_evaluation_reference_judge_keys_no_constitution_file():
    from rlaif.stages.common import named_files

    graded = "evaluate.judges=[{name: graded, judge: reference, constitution: /c.yaml}]"
    cfg = load_config("configs/demo.yaml", [graded])
    assert "evaluate.graded.constitution" not in named_files(cfg, "evaluate")
    assert "label.constitution" in named_files(cfg, "evaluate")  # label's judge reads it


def test_files_are_keyed_by_content_not_by_how_their_path_is_spelled(copies, tmp_path, monkeypatch):
    """data/p.jsonl, ./data/p.jsonl, its absolute path and its file:// URL are one input: a run launched from another
    directory (or by KFP or Airflow, which spell paths their own way) reuses its outputs. Another file's content is
    still another key."""
    from rlaif.stages.common import content_keyed_fields

    demo = str(Path("configs/demo.yaml").resolve())

    def stage_keys(prompts: str, constitution: str, judge: str, demonstrations: str) -> dict[str, str]:
        cfg = load_config(demo, [
            f"data.prompts={prompts}", f"label.constitution={constitution}",
            f"policy.tiny.demonstrations={demonstrations}",
            f"evaluate.judges=[{{name: heldout, judge: hf, hf: {{model: {judge}}}, constitution: {constitution}}}]"])
        return {s.name: stage_config_hash(cfg, s.config_sections, file_digests(cfg, s.name),
                                          content_keyed_fields(cfg, s.name)) for s in STAGES}

    monkeypatch.chdir(tmp_path)
    roles = ("prompts", "constitution", "judge", "demonstrations")
    names = {role: copies[role].name for role in roles}
    relative = stage_keys(*names.values())
    for spelling in ("./{}", str(tmp_path) + "/{}", f"file://{tmp_path}/{{}}"):
        assert stage_keys(*(spelling.format(names[role]) for role in roles)) == relative, spelling
    copies["prompts"].write_text(copies["prompts"].read_text().replace("How do I", "How can I", 1))
    assert all(key != relative[name] for name, key in stage_keys(*names.values()).items())
    # keyed by content, the name's suffix still counts: it says how auto reads the same bytes (.txt: each line)
    as_text = tmp_path / "prompts.txt"
    as_text.write_text("prompt\nWhat is X?\nHow do I Y?\n")
    as_csv = tmp_path / "prompts.csv"
    as_csv.write_bytes(as_text.read_bytes())
    others = [names["constitution"], names["judge"], names["demonstrations"]]
    assert stage_keys(str(as_text), *others)["generate"] != stage_keys(str(as_csv), *others)["generate"]

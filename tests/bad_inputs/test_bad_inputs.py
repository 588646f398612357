"""Bad input a user can give, across the CLI and every stage: each ends in one line naming the problem and the fix,
exit code 2, no traceback, and nothing written that a later stage would trust (no manifest)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def rlaif(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "rlaif", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def assert_clean_failure(proc, needle):
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if not re.search(r"\d+%\|", line)]  # progress bars
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_config_key(tmp_path):
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path), "--set",
                 "ppo.learning_rate=1")
    assert_clean_failure(proc, "unknown config key 'ppo.learning_rate'")
    assert list(tmp_path.iterdir()) == []


def test_missing_prompts_file(tmp_path):
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path), "--set",
                 "data.prompts=missing.jsonl")
    assert_clean_failure(proc, "prompts file not found: missing.jsonl")
    assert not list(tmp_path.rglob("manifest.json"))


def test_unwritable_storage_root(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", f"file://{blocker}/runs")
    assert_clean_failure(proc, "is not writable")


def test_unsupported_storage_scheme():
    assert_clean_failure(rlaif("run", "--storage-root", "gs://bucket/x"), "only file:// and s3://")


def test_stage_without_its_input(tmp_path):
    proc = rlaif("stage", "label", "--config", "configs/tiny.yaml", "--set", f"storage.root={tmp_path}")
    assert_clean_failure(proc, "run stage 'generate' first")


@pytest.mark.parametrize("args", [["graph"], ["--help"]])
def test_graph_and_help(args):
    proc = rlaif(*args)
    assert proc.returncode == 0 and ("generate" in proc.stdout)


def test_launch_refuses_bad_overrides_json(tmp_path):
    proc = rlaif("launch", "generate", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path),
                 "--set-json", "ppo.lr=1")
    assert_clean_failure(proc, "--set-json must be a JSON list of KEY=VALUE strings")
    assert list(tmp_path.iterdir()) == []


def test_launch_of_a_stage_whose_input_is_missing(tmp_path):
    proc = rlaif("launch", "label", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path))
    assert_clean_failure(proc, "generate")
    assert not list(tmp_path.rglob("manifest.json"))


def test_multinode_stage_outside_a_cluster(tmp_path):
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path), "--set", "train_rm.nodes=2")
    assert_clean_failure(proc, "train_rm.nodes=2 needs a Kubernetes cluster")
    assert not list(tmp_path.rglob("manifest.json"))


def no_manifest(root: Path) -> bool:
    return not list(root.rglob("manifest.json"))


@pytest.mark.parametrize("override, needle", [
    ("ppo.lr=fast", "bad value for config key 'ppo.lr'"),
    ("data.eval_fraction=1.5", "bad value for config key 'data.eval_fraction'"),
    ("generate.samples_per_prompt=1", "bad value for config key 'generate.samples_per_prompt'"),
    ("label.judge=gpt", "bad value for config key 'label.judge'"),
    ("label.min_confidence=0.7", "bad value for config key 'label.min_confidence'"),
    ("ppo.nproc=0", "bad value for config key 'ppo.nproc'"),
    ("run_id=../escape", "bad value for config key 'run_id'"),
    ("label.constitution=missing.yaml", "constitution file not found: missing.yaml"),
    ("label.judge=hf", "label: judge 'hf' needs label.hf.model"),
    ("label.judge=openai", "label: judge 'openai' needs label.openai.base_url"),
    ("label.mode=score", "label.mode=score needs a judge that scores one response alone"),
    ("train_rm.nproc=512", "train_rm.nproc=512 is more than this machine's"),
    ("policy.model=/nonexistent/model", "policy model directory not found: /nonexistent/model"),
])
def test_bad_config_values(tmp_path, override, needle):
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", f"file://{tmp_path}", "--set", override)
    assert_clean_failure(proc, needle)
    assert no_manifest(tmp_path)


@pytest.mark.parametrize("name, content, needle", [
    ("empty.jsonl", b"", "holds no prompts"),
    ("latin1.txt", "caf\xe9 au lait\n".encode("latin-1"), "is not UTF-8 (byte 3)"),
    ("huge.txt", b"x" * 3000 + b"\n", "exceeds data.max_prompt_chars=2000"),
    ("noprompt.jsonl", b'{"text": "hi"}\n', "line 1 has no string field 'prompt'"),
    ("broken.jsonl", b'{"prompt": \n', "line 1 is not valid JSON"),
    ("dupes.jsonl", b'{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "line 2 has the prompt id 'a' of"),
])
def test_bad_prompt_files(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content)
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", f"file://{tmp_path}/runs", "--set",
                 f"data.prompts={path}")
    assert_clean_failure(proc, needle)
    assert no_manifest(tmp_path)


def test_bad_config_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo: [unclosed\n")
    assert_clean_failure(rlaif("run", "--config", str(bad)), "is not valid YAML")
    assert_clean_failure(rlaif("run", "--config", str(tmp_path / "none.yaml")), "config file not found")
    assert_clean_failure(rlaif("run", "--config", "configs/tiny.yaml", "--set", "ppo.lr"), "expected KEY=VALUE")
    bad.write_text("- just\n- a list\n")
    assert_clean_failure(rlaif("run", "--config", str(bad)), "must hold a mapping of sections")


def small_model(path: Path, tokenizer_vocab: int, model_vocab: int, safetensors: bool = True) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlaif.models.tiny import _train_tokenizer

    tok = _train_tokenizer([f"sample text {i} with words" for i in range(200)], tokenizer_vocab)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=model_vocab, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    model.save_pretrained(path, safe_serialization=safetensors)
    tok.save_pretrained(path)
    if not safetensors:  # transformers 5 writes safetensors whatever safe_serialization says: a pickle instead
        for f in path.glob("*.safetensors"):
            f.unlink()
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path


@pytest.mark.parametrize("kind, needle", [
    ("no-safetensors", "has no .safetensors weights, only pickled ones"),
    ("no-weights", "has no weights (no .safetensors files): save the model into it"),
    ("mismatch", "do not belong together"),
    ("no-config", "has no config.json"),
])
def test_bad_policy_directories(tmp_path, kind, needle):
    model = tmp_path / "model"
    if kind == "no-config":
        model.mkdir()
        (model / "model.safetensors").write_bytes(b"")
    else:
        small_model(model, tokenizer_vocab=300, model_vocab=64 if kind == "mismatch" else 300,
                    safetensors=kind not in ("no-safetensors", "no-weights"))
        for weights in model.glob("*.bin") if kind == "no-weights" else ():
            weights.unlink()
    proc = rlaif("stage", "generate", "--config", "configs/tiny.yaml", "--set", f"storage.root=file://{tmp_path}/runs",
                 "--set", f"policy.model={model}")
    assert_clean_failure(proc, needle)
    assert no_manifest(tmp_path)


@pytest.mark.parametrize("command, edit, needle", [
    # A pad_token_id past the vocabulary fails in the class's constructor (an AssertionError in nn.Embedding)
    ("run", {"pad_token_id": 100_000}, "(AssertionError: Padding_idx must be within num_embeddings): check its "
                                       "config.json"),
    ("stage", {"pad_token_id": 100_000}, "(AssertionError: Padding_idx must be within num_embeddings)"),
    # transformers 5 validates the config with huggingface_hub's own error class, not a ValueError
    ("stage", {"num_attention_heads": 3},
     "config.json does not validate (Class validation error for validator 'validate_architecture': ValueError: "
     "The hidden size (16) is not a multiple"),
    ("run", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "holds a quantized checkpoint"),
])
def test_a_model_config_its_class_cannot_be_built_from(tmp_path, command, edit, needle):
    # Refused before any stage by `rlaif run`, and by the loader of a stage run by hand, as one line each.
    model = small_model(tmp_path / "model", tokenizer_vocab=300, model_vocab=300)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    args = ("--config", "configs/tiny.yaml", "--set", f"storage.root=file://{tmp_path}/runs", "--set",
            f"train_rm.backbone={model}" if command == "run" else f"policy.model={model}")
    proc = rlaif("run", *args) if command == "run" else rlaif("stage", "generate", *args)
    assert_clean_failure(proc, needle)
    assert no_manifest(tmp_path)


def test_label_shards_with_missing_fields(tmp_path):
    from rlaif.config import load_config
    from rlaif.io import manifest
    from rlaif.io.shards import ShardWriter
    from rlaif.stages.common import context

    overrides = [f"storage.root=file://{tmp_path}", "label.judge=rules"]
    url = f"file://{tmp_path}/tiny/generate"
    with ShardWriter(url, 5) as writer:
        writer.write({"__key__": "p0", "prompt.txt": "q", "response_b.txt": "b"})
    # as if this config's generate had written it (an output of other settings is refused before it is read)
    generate = context(load_config("configs/tiny.yaml", overrides), "generate")
    manifest.write(url, stage="generate", run_id="tiny", config_hash=generate.config_hash, inputs={},
                   shards=writer.shards)
    proc = rlaif("stage", "label", "--config", "configs/tiny.yaml", "--set", overrides[0], "--set", overrides[1])
    assert_clean_failure(proc, "pair p0 in")
    assert "lacks response_a.txt: re-run stage 'generate'" in proc.stderr
    assert not (tmp_path / "tiny/label/manifest.json").exists()


def test_bad_shard_arguments(tmp_path):
    args = ("--config", "configs/tiny.yaml", "--set", f"storage.root=file://{tmp_path}")
    assert_clean_failure(rlaif("stage", "generate", *args, "--shard-index", "4", "--num-shards", "2"), "outside 0..1")
    assert_clean_failure(rlaif("stage", "label", *args, "--num-shards", "2"), "splits stage 'generate' only")

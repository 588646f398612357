"""Hub model ids: told apart from local paths and URLs, resolved from the Hugging Face cache in offline mode (the tests
never reach a hub), a clear one-line error when a model is neither there nor reachable, and the resolved commit in
the cache key."""
import json

import pytest

from rlaif.errors import UserError
from rlaif.io import hub
from rlaif.io.digest import spec_digest
from rlaif.models.loading import resolve


@pytest.mark.parametrize("spec, parsed", [
    ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", None)),
    ("org/name@v1.2", ("org/name", "v1.2")),
    ("hf://org/name", ("org/name", None)),
    ("hf://org/name@0123abc", ("org/name", "0123abc")),
    ("s3://bucket/models/policy", None),
    ("builtin:tiny-llama", None),
    ("./models/policy", None),
    ("/opt/models/policy", None),
    ("a/b/c", None),  # a path, not a hub id
])
def test_hub_ids_are_told_apart(spec, parsed):
    assert hub.parse(spec) == parsed


def test_an_existing_local_directory_wins(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.parse("org/name") is None


def test_offline_and_not_cached_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import otherwise
    with pytest.raises(UserError) as err:
        resolve("some-org/not-cached", "policy model")
    message = str(err.value)
    assert "HF_HUB_OFFLINE=1" in message and "not in the Hugging Face cache" in message and "\n" not in message
    assert spec_digest("some-org/not-cached", model=True).endswith(":unresolved")
    assert not spec_digest("some-org/not-cached").startswith("hub:")  # a missing file is not a hub model


def test_offline_resolves_from_the_cache(tmp_path, monkeypatch):
    """A model in the standard cache layout (models--org--name/snapshots/<commit>, refs/main) resolves offline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / commit
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(snapshot, safe_serialization=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import otherwise
    path = resolve("acme/tiny", "policy model")
    assert path.name == commit and json.loads((path / "config.json").read_text())["hidden_size"] == 16
    assert spec_digest("acme/tiny", model=True) == f"hub:acme/tiny@{commit}"
    assert resolve("hf://acme/tiny", "policy model") == path


@pytest.mark.parametrize("spec", ["org/my--model", "org/name."])
def test_ids_the_hub_refuses_are_one_line(tmp_path, monkeypatch, spec):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError) as err:
        resolve(spec, "policy model")
    assert "not a valid hub model id" in str(err.value) and "\n" not in str(err.value)

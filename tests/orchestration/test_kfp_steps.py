"""What a component runs in its container, without KFP: the typed pipeline parameters become overrides that the
config loader reads back exactly (unset values keep the config's), and a trained model is published as a Model
artifact (card + location) with Metrics."""
import json
from types import SimpleNamespace

from rlaif.config import load_config
from rlaif.io import storage
from rlaif.orchestration.kfp_steps import publish_model, typed_overrides


def test_unset_typed_parameters_keep_the_config():
    assert typed_overrides() == []
    assert typed_overrides(policy_model="", judge="", ppo_lr=0.0, kl_coef=-1.0, iterations=0, seed=-1) == []


def test_typed_parameters_reach_the_config():
    overrides = typed_overrides(policy_model="Qwen/Qwen2.5-0.5B", judge="rules", ppo_lr=1e-5, kl_coef=0.0,
                                iterations=7, seed=3)
    cfg = load_config("configs/tiny.yaml", ["ppo.lr=0.5", *overrides])  # typed ones come last: they win
    assert (cfg.policy.model, cfg.label.judge, cfg.ppo.lr, cfg.ppo.kl_coef, cfg.ppo.iterations, cfg.seed) == (
        "Qwen/Qwen2.5-0.5B", "rules", 1e-5, 0.0, 7, 3)


class FakeMetrics:
    def __init__(self):
        self.logged = {}

    def log_metric(self, key, value):
        self.logged[key] = value


def test_publish_model_writes_card_location_metadata_and_metrics(tmp_path):
    stage_url = f"file://{tmp_path}/run/train_rm"
    storage.write_bytes_atomic(storage.join(stage_url, "model", "README.md"), b"---\nbase_model: x\n---\n# card\n")
    summary = {"held_out_accuracy": 0.9, "steps": 12, "held_out_reference_accuracy": None}
    result = {"digest": "d" * 64, "summary": summary,
              "files": [{"path": "model/README.md"}, {"path": "model/model.safetensors"}, {"path": "metrics.jsonl"}]}
    model, metrics = SimpleNamespace(path=str(tmp_path / "artifact"), metadata={}), FakeMetrics()
    publish_model(result, stage_url, "model", model, metrics, ("held_out_accuracy", "steps",
                                                               "held_out_reference_accuracy"))
    assert (tmp_path / "artifact" / "README.md").read_text().startswith("---\nbase_model: x")
    location = json.loads((tmp_path / "artifact" / "location.json").read_text())
    assert location == {"url": f"{stage_url}/model", "files": ["model/README.md", "model/model.safetensors"],
                        "manifest_digest": "d" * 64}
    assert metrics.logged == {"held_out_accuracy": 0.9, "steps": 12.0}  # None is not a metric
    assert model.metadata == {"storage_url": f"{stage_url}/model", "framework": "transformers",
                              "held_out_accuracy": 0.9, "steps": 12.0}

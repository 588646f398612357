import pytest

from rlaif.config import PipelineConfig, apply_overrides, load_config, stage_config_hash
from rlaif.errors import UserError
from rlaif.graph import STAGE_BY_NAME, STAGES, Resources, Stage, render, topological_order


def test_demo_and_tiny_configs_validate():
    for path in ("configs/demo.yaml", "configs/tiny.yaml"):
        assert isinstance(load_config(path), PipelineConfig)


def test_overrides_are_typed_and_nested():
    cfg = load_config("configs/tiny.yaml", ["ppo.lr=1e-5", "generate.max_prompts=null", "run_id=abc",
                                            "evaluate.n_prompts=3"])
    assert (cfg.ppo.lr == 1e-5 and cfg.generate.max_prompts is None and cfg.run_id == "abc"
            and cfg.evaluate.n_prompts == 3)


@pytest.mark.parametrize("override,needle", [
    ("ppo.lrr=1", "unknown config key 'ppo.lrr'"),
    ("nonsense=1", "unknown config key 'nonsense'"),
    ("ppo.lr=fast", "bad value for config key 'ppo.lr'"),
    ("data.eval_fraction=1.5", "bad value for config key 'data.eval_fraction'"),
    ("label.judge=gpt", "bad value for config key 'label.judge'"),
    ("run_id=a/b", "bad value for config key 'run_id'"),
])
def test_bad_config_is_one_line_naming_the_key(override, needle):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_override_without_equals_and_missing_file():
    with pytest.raises(UserError, match="KEY=VALUE"):
        apply_overrides({}, ["ppo.lr"])
    with pytest.raises(UserError, match="config file not found"):
        load_config("configs/nope.yaml")


def test_stage_hash_covers_its_sections_and_inputs_only():
    base = PipelineConfig()
    sections = STAGE_BY_NAME["train_rm"].config_sections
    h = stage_config_hash(base, sections, {"label": "d1"})
    assert h == stage_config_hash(PipelineConfig(), sections, {"label": "d1"})
    assert h != stage_config_hash(PipelineConfig(train_rm={"lr": 3e-4}), sections, {"label": "d1"})
    assert h != stage_config_hash(base, sections, {"label": "d2"})
    assert h != stage_config_hash(PipelineConfig(seed=1), sections, {"label": "d1"})
    assert h == stage_config_hash(PipelineConfig(ppo={"lr": 1.0}), sections, {"label": "d1"})  # not its section


def test_graph_order_and_wiring():
    order = [s.name for s in topological_order()]
    assert order == ["generate", "label", "train_rm", "ppo", "evaluate"]
    for stage in STAGES:
        assert all(order.index(dep) < order.index(stage.name) for dep in stage.inputs)
        assert set(stage.config_sections) <= set(PipelineConfig.model_fields)
        assert stage.argv("cfg.yaml", ("a=1",)) == ["rlaif", "stage", stage.name, "--config", "cfg.yaml", "--set",
                                                    "a=1"]
    assert {s.name for s in STAGES if s.resources.torchrun} == {"generate", "train_rm", "ppo"}
    assert "[torchrun; cpu=8 mem=32Gi gpu=1]" in render()


def test_graph_rejects_cycles_and_unknown_inputs():
    a = Stage("a", "", ("b",), (), (), False, Resources())
    b = Stage("b", "", ("a",), (), (), False, Resources())
    with pytest.raises(ValueError, match="cycle"):
        topological_order((a, b))
    with pytest.raises(ValueError, match="unknown stage"):
        topological_order((Stage("c", "", ("zzz",), (), (), False, Resources()),))

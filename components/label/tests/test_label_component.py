"""The `label` component: its interface against rlaif/graph.py, its compiled YAML, its README (tables and recipe) and
its GPU rule (none when the judge runs no model). Fast: nothing here runs a stage."""
import pytest
import yaml
from kfp import compiler
from rlaif_components.checks import ComponentContract

from rlaif.orchestration import kfp_pipeline
from rlaif.orchestration.cluster import ClusterSpec
from rlaif.orchestration.pod import JUDGES_WITHOUT_MODEL


class TestLabelComponent(ComponentContract):
    NAME = "label"


def compiled_label_container(tmp_path, judge: "str | None") -> dict:
    out = tmp_path / f"pipeline-{judge}.yaml"
    compiler.Compiler().compile(kfp_pipeline.build_pipeline(judge=judge), str(out))
    docs = list(yaml.safe_load_all(out.read_text()))
    return docs[0]["deploymentSpec"]["executors"]["exec-label"]["container"]


@pytest.mark.parametrize("judge", JUDGES_WITHOUT_MODEL)
def test_label_gets_no_gpu_when_its_judge_runs_no_model(tmp_path, judge):
    container = compiled_label_container(tmp_path, judge)
    assert "accelerator" not in container["resources"]
    assert container["image"] == ClusterSpec().image


@pytest.mark.parametrize("judge", [None, "embedding", "hf"])
def test_label_gets_a_gpu_when_its_judge_runs_a_model(tmp_path, judge):
    container = compiled_label_container(tmp_path, judge)
    accelerator = container["resources"]["accelerator"]
    assert accelerator["resourceType"] == "nvidia.com/gpu" and int(accelerator["resourceCount"]) == 1
    assert container["image"] == ClusterSpec().gpu_image


def test_readme_names_the_judges_that_need_no_gpu():
    resources = "\n".join(TestLabelComponent().readme_section("## Resources"))
    for judge in JUDGES_WITHOUT_MODEL:
        assert f"`{judge}`" in resources, f"README.md: Resources must name the judge {judge!r} (no GPU)"

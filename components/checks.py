"""The contract every component's tests check (each components/<stage>/tests/ subclasses `ComponentContract`): its
interface against rlaif/graph.py, its compiled YAML, and its README (tables, defaults, and the recipe, executed).
Fast: nothing here runs a stage."""
import re
from pathlib import Path

import yaml
from kfp import compiler

from rlaif.graph import STAGE_BY_NAME
from rlaif.orchestration.cluster import load
from rlaif.orchestration.pod import pod_plan

REPO = Path(__file__).resolve().parents[1]
BASE_PARAMETERS = {"config", "overrides", "run_id", "storage_root", "default_run_id"}
# The settings runs are compared by in the KFP UI; optional (each has an "unset" default).
TYPED_PARAMETERS = {"policy_model", "judge", "ppo_lr", "kl_coef", "iterations", "seed"}
COMMON_PARAMETERS = BASE_PARAMETERS | TYPED_PARAMETERS


def kfp_name(stage: str) -> str:
    return stage.replace("_", "-")  # KFP task and executor names are DNS-style


def with_ancestors(name: str) -> set[str]:
    """The stage and every stage it reads from, directly or not: what a pipeline running it must run too."""
    return {name}.union(*(with_ancestors(dep) for dep in STAGE_BY_NAME[name].inputs))


class ComponentContract:
    NAME: str
    OUTPUTS: dict[str, str] = {"manifest": "system.Artifact"}

    @property
    def component(self):
        import importlib

        return getattr(importlib.import_module(f"rlaif_components.{self.NAME}.component"), self.NAME)

    @property
    def here(self) -> Path:
        return REPO / "components" / self.NAME

    @property
    def stage(self):
        return STAGE_BY_NAME[self.NAME]

    def readme_section(self, heading: str) -> list[str]:
        """The lines under `heading` up to the next heading of any level."""
        lines = (self.here / "README.md").read_text().splitlines()
        assert heading in lines, f"README.md has no '{heading}' section"
        start = lines.index(heading) + 1
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines))
        return lines[start:end]

    def table_names(self, heading: str) -> list[str]:
        """The backticked names in the first column of the tables in a README section."""
        cells = [line.strip("|").split("|")[0].strip() for line in self.readme_section(heading) if line.startswith("|")]
        return [m.group(1) for cell in cells if (m := re.fullmatch(r"`([^`]+)`", cell))]

    def test_interface_matches_the_graph(self):
        spec = self.component.component_spec
        artifacts_in = {n for n, i in spec.inputs.items() if i.type.startswith("system.")}
        assert artifacts_in == {f"{dep}_manifest" for dep in self.stage.inputs}
        # a stage that can stream an input takes it optionally, and a `streaming` switch (graph.py's streams_from)
        streams = {"streaming"} if self.stage.streams_from else set()
        assert COMMON_PARAMETERS | artifacts_in | streams == set(spec.inputs)
        optional = {n for n in artifacts_in if spec.inputs[n].optional}
        assert optional == ({f"{self.stage.streams_from}_manifest"} if self.stage.streams_from else set())
        assert {n: o.type.split("@")[0] for n, o in spec.outputs.items()} == self.OUTPUTS

    def test_checked_in_yaml_is_a_fresh_compile(self, tmp_path):
        compiler.Compiler().compile(self.component, str(tmp_path / "c.yaml"))
        stale = f"components/{self.NAME}/component.yaml is stale: run `make pipeline` and commit it"
        assert (tmp_path / "c.yaml").read_text() == (self.here / "component.yaml").read_text(), stale

    def test_readme_tables_name_exactly_the_inputs_and_outputs(self):
        spec = self.component.component_spec
        inputs, outputs = self.table_names("## Inputs"), self.table_names("## Outputs")
        assert sorted(inputs) == sorted(spec.inputs), "README.md: the Inputs table must list every input, once"
        assert sorted(outputs) == sorted(spec.outputs), "README.md: the Outputs table must list every output, once"

    def test_readme_states_the_graph_defaults_and_storage_outputs(self):
        text = (self.here / "README.md").read_text()
        resources = self.stage.resources
        assert f"{resources.cpu} CPU, {resources.memory_gib}Gi memory, {resources.gpus} GPU" in text
        assert ("launched with torchrun" in text) == resources.torchrun
        stored = self.table_names(f"### In object storage, under `<storage_root>/<run_id>/{self.NAME}/`")
        for output in self.stage.outputs:
            assert output.split()[0] in stored, f"README.md: {output!r} (graph.py) missing from the storage table"
        assert "manifest.json" in stored

    def run_readme_recipe(self, tmp_path, monkeypatch) -> tuple[dict, dict, dict]:
        """Executes the README's Python block (paths relative to the repository root, as written there), compiling
        to a temporary file; returns the compiled pipeline, its Kubernetes platform spec and the block's namespace."""
        blocks = re.findall(r"```python\n(.*?)```", (self.here / "README.md").read_text(), re.S)
        assert len(blocks) == 1, "README.md: expected one Python block, the recipe"
        code = blocks[0]
        assert "load_component_from_file(" in code and "/component.yaml" in code, "README.md: load the compiled YAMLs"
        target = tmp_path / "my_pipeline.yaml"
        assert '"my_pipeline.yaml"' in code, "README.md: the recipe compiles to my_pipeline.yaml"
        code = code.replace('"my_pipeline.yaml"', repr(str(target)))
        monkeypatch.chdir(REPO)
        namespace: dict = {"__name__": "readme_recipe"}
        exec(compile(code, f"components/{self.NAME}/README.md", "exec"), namespace)
        pipeline, platform = yaml.safe_load_all(target.read_text())
        return pipeline, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"], namespace

    def test_readme_recipe_compiles_a_user_pipeline(self, tmp_path, monkeypatch):
        pipeline, platform, namespace = self.run_readme_recipe(tmp_path, monkeypatch)
        tasks = pipeline["root"]["dag"]["tasks"]
        stages = with_ancestors(self.NAME)
        assert set(tasks) == {kfp_name(s) for s in stages}
        cluster = load(str(REPO / "configs/cluster.yaml"))
        for name in stages:
            task, stage = tasks[kfp_name(name)], STAGE_BY_NAME[name]
            assert sorted(task.get("dependentTasks", [])) == sorted(kfp_name(dep) for dep in stage.inputs), name
            for dep in stage.inputs:  # each upstream manifest comes from that component's `manifest` output
                src = task["inputs"]["artifacts"][f"{dep}_manifest"]["taskOutputArtifact"]
                assert src == {"outputArtifactKey": "manifest", "producerTask": kfp_name(dep)}, name
            params = task["inputs"]["parameters"]
            assert params["default_run_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_name}}"}}, name
            passed = BASE_PARAMETERS - {"default_run_id"}
            assert all(params[p] == {"componentInputParameter": p} for p in passed), name
            # configure_task(task, pod_plan(...)) sized the pod as the full pipeline does
            plan = pod_plan(stage, cluster, namespace.get("JUDGE"))
            container = pipeline["deploymentSpec"]["executors"][f"exec-{kfp_name(name)}"]["container"]
            assert container["image"] == plan.image, name
            resources = container["resources"]
            assert resources["resourceCpuRequest"] == str(plan.cpu), name
            assert resources["resourceMemoryLimit"] == f"{plan.memory_gib}Gi", name
            assert int(resources.get("accelerator", {}).get("resourceCount", 0)) == plan.gpus, name
            assert platform[f"exec-{kfp_name(name)}"]["emptyDirMounts"][0]["mountPath"] == "/dev/shm", name
            assert "rlaif-storage" in {s["secretName"] for s in platform[f"exec-{kfp_name(name)}"]["secretAsEnv"]}, name

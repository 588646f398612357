"""One pod plan, three translations: the KFP task, the TrainJob and the PyTorchJob render the same pod as
`pod.pod_plan` (tests/airflow/test_dags.py checks the Airflow pod against the same plan). Also: GPUs follow the judge
and cluster.yaml's per-stage sizes; bad cluster settings are one-line errors."""
import json

import pytest
import yaml

from rlaif.config import LabelConfig, load_config
from rlaif.errors import UserError
from rlaif.graph import STAGE_BY_NAME, STAGES
from rlaif.orchestration import cluster, jobs, kfp_pipeline
from rlaif.orchestration.cluster import ClusterSpec, StageResources, Toleration
from rlaif.orchestration.pod import JUDGES_WITHOUT_MODEL, POD_JUDGES, SIZED_FOR_JUDGE_ENV, pod_plan

# A cluster with every knob away from its default, so a translator that drops one is caught.
SPEC = ClusterSpec(
    gpus_per_node=4, gpu_node_selector={"nvidia.com/gpu.product": "H100"}, node_selector={"pool": "ml"},
    gpu_tolerations=(Toleration(key="nvidia.com/gpu"), Toleration(key="team", operator="Equal", value="a")),
    env={"AWS_ENDPOINT_URL": "http://minio.minio:9000"}, shm_gib=16, run_as_user=1234,
    service_account="rlaif-runner", stages={"evaluate": StageResources(cpu=6, memory_gib=24, gpus=2)},
)


def comparable(pod_spec: dict) -> dict:
    """The parts of a PodSpec that the plan decides, in one canonical form."""
    (container,) = pod_spec["containers"]
    env = sorted((e["name"], json.dumps(e.get("value") or e["valueFrom"], sort_keys=True)) for e in container["env"])
    return {
        "image": container["image"], "resources": container["resources"], "env": env,
        "mounts": sorted((m["name"], m["mountPath"]) for m in container.get("volumeMounts", [])),
        "nodeSelector": pod_spec.get("nodeSelector") or {},
        "tolerations": sorted(json.dumps(t, sort_keys=True) for t in pod_spec.get("tolerations") or []),
        "volumes": pod_spec.get("volumes") or [],
    }


def kfp_pod(compiled: dict, platform: dict, stage: str) -> dict:
    """A KFP task's container and kubernetes platform spec, read back as a PodSpec."""
    executor = f"exec-{stage.replace('_', '-')}"
    container = compiled["deploymentSpec"]["executors"][executor]["container"]
    extras = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"][executor]
    res = container["resources"]
    resources = {"requests": {"cpu": res["resourceCpuRequest"], "memory": res["resourceMemoryRequest"]},
                 "limits": {"memory": res["resourceMemoryLimit"]}}
    if "accelerator" in res:
        resources["limits"][res["accelerator"]["resourceType"]] = res["accelerator"]["resourceCount"]
    env = [{"name": e["name"], "value": e["value"]} for e in container.get("env", [])]
    for secret in extras.get("secretAsEnv", []):
        for pair in secret["keyToEnv"]:
            ref = {"name": secret["secretName"], "key": pair["secretKey"], "optional": secret["optional"]}
            env.append({"name": pair["envVar"], "valueFrom": {"secretKeyRef": ref}})
    shm = extras["emptyDirMounts"]
    assert extras["securityContext"] == {"runAsNonRoot": True, "runAsUser": str(SPEC.run_as_user)}
    return {
        "containers": [{"image": container["image"], "resources": resources, "env": env,
                        "volumeMounts": [{"name": m["volumeName"], "mountPath": m["mountPath"]} for m in shm]}],
        "nodeSelector": extras.get("nodeSelector", {}).get("labels", {}),
        "tolerations": extras.get("tolerations", []),
        "volumes": [{"name": m["volumeName"], "emptyDir": {"medium": m["medium"], "sizeLimit": m["sizeLimit"]}}
                    for m in shm],
    }


def expected(stage, judge=None, spec=SPEC) -> dict:
    return comparable(pod_plan(STAGE_BY_NAME[stage], spec, judge).pod_spec("main", ["rlaif"]))


@pytest.mark.parametrize("judge", [None, "rules"])
def test_kfp_tasks_render_the_plan(tmp_path, judge):
    from kfp import compiler

    out = tmp_path / "p.yaml"
    compiler.Compiler().compile(kfp_pipeline.build_pipeline(SPEC, judge), str(out))
    compiled, platform = yaml.safe_load_all(out.read_text())
    for stage in STAGES:
        assert comparable(kfp_pod(compiled, platform, stage.name)) == expected(stage.name, judge), stage.name


def test_kfp_tasks_keep_every_secret_variable(tmp_path):
    """One secret key feeding two variables kept only the last in KFP, and one secret listed twice took its first
    entry's `optional` for both; the Airflow pods and the TrainJobs had them right."""
    from dataclasses import replace

    from kfp import compiler

    secrets = (cluster.SecretEnv("storage", {"AWS_ACCESS_KEY_ID": "key", "MINIO_ACCESS_KEY_ID": "key"}),
               cluster.SecretEnv("shared", {"HF_TOKEN": "hf"}, optional=True),
               cluster.SecretEnv("shared", {"RLAIF_JUDGE_API_KEY": "judge"}))
    spec = replace(SPEC, secrets=secrets)
    out = tmp_path / "p.yaml"
    compiler.Compiler().compile(kfp_pipeline.build_pipeline(spec, None), str(out))
    compiled, platform = yaml.safe_load_all(out.read_text())
    for stage in STAGES:
        assert comparable(kfp_pod(compiled, platform, stage.name)) == expected(stage.name, spec=spec), stage.name
    env = kfp_pod(compiled, platform, "generate")["containers"][0]["env"]
    assert {"AWS_ACCESS_KEY_ID", "MINIO_ACCESS_KEY_ID", "HF_TOKEN", "RLAIF_JUDGE_API_KEY"} <= {e["name"] for e in env}


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
@pytest.mark.parametrize("stage", ["train_rm", "ppo"])
def test_multinode_jobs_render_the_plan(api, stage):
    from dataclasses import replace

    cfg = load_config("configs/tiny.yaml", ["run_id=exp"])
    spec = replace(SPEC, multinode_api=api)
    body = jobs.job_manifest(STAGE_BY_NAME[stage], cfg, "s3://b/c.yaml", 2, spec, "ns")
    if api == "pytorchjob":
        pod = body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        assert pod["serviceAccountName"] == "rlaif-runner"
        assert pod["securityContext"] == {"runAsUser": 1234, "runAsNonRoot": True}
    else:
        trainer = body["spec"]["trainer"]
        (override,) = body["spec"]["podTemplateOverrides"]
        assert override["targetJobs"] == [{"name": "node"}]
        assert override["spec"]["serviceAccountName"] == "rlaif-runner"
        (node,) = override["spec"]["containers"]
        container = {"image": trainer["image"], "resources": trainer["resourcesPerNode"], "env": trainer["env"],
                     "volumeMounts": node["volumeMounts"]}
        pod = {**override["spec"], "containers": [container]}
    assert comparable(pod) == expected(stage, spec=spec)
    assert body["metadata"]["labels"]["rlaif/stage"] == stage


def test_gpus_follow_the_judge_and_the_cluster_settings():
    label, evaluate, ppo = STAGE_BY_NAME["label"], STAGE_BY_NAME["evaluate"], STAGE_BY_NAME["ppo"]
    default = ClusterSpec()
    for judge in JUDGES_WITHOUT_MODEL:
        plan = pod_plan(label, default, judge)
        assert plan.gpus == 0 and plan.image == default.image and plan.tolerations == ()
        assert "nvidia.com/gpu" not in plan.resources()["limits"]
    for judge in ("embedding", "hf", None):
        assert pod_plan(label, default, judge).gpus == 1
        assert SIZED_FOR_JUDGE_ENV not in pod_plan(label, default, judge).env
    assert pod_plan(label, default, "rules").env[SIZED_FOR_JUDGE_ENV] == "rules"  # launch refuses hf there
    assert pod_plan(evaluate, default, "rules").gpus == 1  # evaluate generates with the policies: it keeps its GPU
    assert pod_plan(ppo, SPEC).gpus == 4 and pod_plan(evaluate, SPEC).gpus == 2
    assert pod_plan(evaluate, SPEC).resources()["requests"] == {"cpu": "6", "memory": "24Gi"}
    sized = ClusterSpec(stages={"label": StageResources(gpus=1)})
    assert pod_plan(label, sized, "rules").gpus == 1  # an explicit size wins over the judge
    assert SIZED_FOR_JUDGE_ENV not in pod_plan(label, sized, "rules").env
    assert SIZED_FOR_JUDGE_ENV not in pod_plan(label, ClusterSpec(use_gpus=False), "rules").env  # CPU by choice
    no_gpus = ClusterSpec(use_gpus=False, stages={"ppo": StageResources(gpus=8)})
    assert all(pod_plan(s, no_gpus).gpus == 0 and pod_plan(s, no_gpus).image == no_gpus.image for s in STAGES)


def test_gpus_per_node_zero_means_cpu_pods(tmp_path):
    """0 is not "unset": the GPU stages get CPU pods (the CPU image, no GPU limit, no GPU scheduling), where launch
    runs the config's nproc ranks over gloo."""
    spec_file = tmp_path / "c.yaml"
    spec_file.write_text("gpus_per_node: 0\ngpu_node_selector: {nvidia.com/gpu.product: H100}\n")
    spec = cluster.load(str(spec_file))
    for stage in STAGES:
        plan = pod_plan(stage, spec)
        assert plan.gpus == 0 and plan.image == spec.image and plan.tolerations == () and plan.node_selector == {}
        assert "nvidia.com/gpu" not in plan.resources()["limits"]
    cfg = load_config("configs/tiny.yaml", ["run_id=exp"])
    job = jobs.job_manifest(STAGE_BY_NAME["ppo"], cfg, "u", 2, spec, "ns")
    assert job["spec"]["trainer"]["numProcPerNode"] == cfg.ppo.nproc  # CPU ranks, as with use_gpus: false
    sized = ClusterSpec(gpus_per_node=0, stages={"ppo": StageResources(gpus=2)})
    assert pod_plan(STAGE_BY_NAME["ppo"], sized).gpus == 2  # a stage's own size still wins


def test_every_judge_is_classified():
    judges = set(LabelConfig.model_fields["judge"].annotation.__args__) | {"served"}  # served: JudgeSettings.pod_judge
    assert set(JUDGES_WITHOUT_MODEL) < judges  # a renamed judge must not silently get a GPU again
    assert sorted(POD_JUDGES) == sorted(judges)  # the DAGs' $RLAIF_LABEL_JUDGE accepts exactly the config's judges


def test_compile_sizes_label_from_the_config(tmp_path):
    config = tmp_path / "rules.yaml"
    config.write_text("label:\n  judge: rules\n")
    out = tmp_path / "p.yaml"
    kfp_pipeline.compile_pipeline(str(out), None, None, str(config))
    compiled, _ = yaml.safe_load_all(out.read_text())
    executors = compiled["deploymentSpec"]["executors"]
    assert "accelerator" not in executors["exec-label"]["container"]["resources"]
    assert "accelerator" in executors["exec-generate"]["container"]["resources"]


@pytest.mark.parametrize("text, message", [
    ("stages: {labl: {gpus: 0}}", "unknown stage(s) labl"),
    ("stages: {label: {gpu: 0}}", "unknown stages.label key(s) gpu; known: cpu, gpus, memory_gib"),
    ("stages: {label: 4}", "stages.label: give a mapping with keys among cpu, memory_gib, gpus"),
    ("stages: [ppo]", "stages must map stage names to pod sizes"),
    ("gpu_tolerations: nvidia.com/gpu", "gpu_tolerations must be a list of entries"),
    ("gpu_tolerations: [nvidia.com/gpu]", "gpu_tolerations: give a mapping with keys among key, operator"),
    ("gpu_tolerations: [{value: x}]", "an entry without a key tolerates every taint and needs operator Exists"),
    ("secrets: [{name: s, env: HF_TOKEN}]", "secrets: env must map text to text, got 'HF_TOKEN'"),
    ("secrets: [{name: s, env: {HF_TOKEN: t}, optional: 'yes'}]", "secrets: optional must be true or false"),
    ("secrets: [{env: {HF_TOKEN: t}}]", "lacks name"),
    ("stages: {ppo: {cpu: -1}}", "cpu must be a whole number >= 0"),
    ("stages: {ppo: {cpu: '4'}}", "stages.ppo: cpu must be a whole number, not '4'"),
    ("stages: {ppo: {memory_gib: 0}}", "cpu and memory_gib must be at least 1"),
    ("use_gpu: true", "unknown cluster setting(s) use_gpu"),
    ("image: [a", "cluster settings"),
    ("- a\n- b", "expected a mapping"),
])
def test_bad_cluster_settings_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        cluster.load(str(path))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_cluster_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot read it"):
        cluster.load(str(tmp_path / "nope.yaml"))

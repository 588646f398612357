"""DAG integrity (Astronomer style), the rendered pod spec of every `rlaif` task, the stage assets, `rlaif_local`'s
S3 connection (aws_conn_id), and a failing `rlaif_local` run under dag.test(); test_scheduler.py runs it end to end."""
import json
import os
from pathlib import Path

import pytest
from airflow.dag_processing.dagbag import DagBag

from rlaif.graph import STAGE_BY_NAME, STAGES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dagbag():
    return DagBag(dag_folder=str(REPO / "dags"))


def test_dags_import_cleanly(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == {"rlaif", "rlaif_local", "rlaif_on_new_policy"}


@pytest.mark.parametrize("dag_id", ["rlaif", "rlaif_local"])
def test_dag_is_the_stage_graph(dagbag, dag_id):
    dag = dagbag.get_dag(dag_id)
    assert set(dag.task_ids) == set(STAGE_BY_NAME)
    for stage in STAGES:
        task = dag.get_task(stage.name)
        assert task.upstream_task_ids == set(stage.inputs), stage.name
        assert task.retries >= 1 and task.doc_md == stage.description
        assert [(a.name, a.uri) for a in task.outlets] == [(f"rlaif://stages/{stage.name}",) * 2], stage.name
    assert "rlaif" in dag.tags and dag.doc_md.startswith("# RLAIF")
    # aws_conn_id only where a task process can take the connection's keys (a pod would carry them in its spec)
    local_only = {"aws_conn_id"} if dag_id == "rlaif_local" else set()
    assert set(dag.params) == {"config", "overrides", "run_id", "storage_root", *local_only}
    assert dag.max_active_runs == 1
    # no cycles: a topological sort consumes every task
    assert len(dag.topological_sort()) == len(STAGES)


def test_example_consumer_is_scheduled_on_the_ppo_asset(dagbag):
    consumer = dagbag.get_dag("rlaif_on_new_policy")
    (policy,) = dagbag.get_dag("rlaif_local").get_task("ppo").outlets
    assert consumer.timetable.asset_condition.objects == (policy,)


def _rendered(task, **params):
    from types import SimpleNamespace

    context = {"params": {"config": "configs/demo.yaml", "overrides": [], "run_id": "", "storage_root": "", **params},
               "dag_run": SimpleNamespace(run_id="scheduled__2026-11-22T00:00:00+00:00")}
    return task.render_template(task.arguments, context)


def _comparable(pod_spec: dict) -> dict:
    """The parts of a PodSpec that the pod plan decides (as in tests/orchestration/test_pod_plan.py)."""
    (container,) = pod_spec["containers"]
    env = sorted((e["name"], json.dumps(e.get("value") or e["valueFrom"], sort_keys=True)) for e in container["env"]
                 if e["name"] != "RLAIF_LOCK_OWNER")  # Airflow's own: the task instance that holds the stage lock
    return {
        "image": container["image"], "command": container["command"], "resources": container["resources"],
        "env": env, "mounts": sorted((m["name"], m["mountPath"]) for m in container.get("volumeMounts", [])),
        "nodeSelector": pod_spec.get("nodeSelector") or {},
        "tolerations": sorted(json.dumps(t, sort_keys=True) for t in pod_spec.get("tolerations") or []),
        "volumes": pod_spec.get("volumes") or [], "securityContext": pod_spec.get("securityContext"),
        "serviceAccountName": pod_spec.get("serviceAccountName"),
    }


def test_pod_spec_of_every_stage_is_the_pod_plan(dagbag):
    """The same plan the KFP tasks and the TrainJobs render (tests/orchestration/test_pod_plan.py)."""
    from kubernetes.client import ApiClient

    from rlaif.orchestration import cluster
    from rlaif.orchestration.pod import pod_plan

    dag = dagbag.get_dag("rlaif")
    for stage in STAGES:
        task = dag.get_task(stage.name)
        pod = ApiClient().sanitize_for_serialization(task.build_pod_request_obj(context=None, dry_run=True))
        spec = cluster.load(os.environ.get("RLAIF_CLUSTER_CONFIG"))
        plan = pod_plan(stage, spec, os.environ.get("RLAIF_LABEL_JUDGE"))
        assert _comparable(pod["spec"]) == _comparable(plan.pod_spec("base", ["rlaif"])), stage.name
        (container,) = pod["spec"]["containers"]
        assert "RLAIF_LOCK_OWNER" in {e["name"] for e in container["env"]}
        assert pod["metadata"]["namespace"] == "team-a"
        args = _rendered(task, overrides=["ppo.lr=1e-5"], storage_root="s3://bucket/rlaif")
        assert args[:2] == ["launch", stage.name]
        assert json.loads(args[args.index("--set-json") + 1]) == ["ppo.lr=1e-5"]
        assert args[args.index("--run-id") + 1] == ""  # no run_id param: launch takes the DAG run's, made safe
        assert args[args.index("--default-run-id") + 1] == "scheduled__2026-11-22T00:00:00+00:00"
        assert args[args.index("--storage-root") + 1] == "s3://bucket/rlaif"
        assert _rendered(task, run_id="exp-7")[args.index("--run-id") + 1] == "exp-7"
    assert "nvidia.com/gpu" not in dag.get_task("label").container_resources.limits  # RLAIF_LABEL_JUDGE=rules
    assert dag.get_task("evaluate").container_resources.requests == {"cpu": "6", "memory": "24Gi"}


def test_a_streaming_dag_runs_label_beside_generate(monkeypatch):
    """RLAIF_LABEL_STREAMING=1 (configs with label.streaming): in both DAGs label no longer waits for generate, still
    its own task, and launches with streaming on; every other edge is the graph's."""
    import importlib.util

    monkeypatch.setenv("RLAIF_LABEL_STREAMING", "1")
    spec = importlib.util.spec_from_file_location("rlaif_dags_streaming", REPO / "dags/rlaif_dags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for dag in (module.rlaif, module.rlaif_local):
        assert set(dag.task_ids) == set(STAGE_BY_NAME) and dag.get_task("label").upstream_task_ids == set()
        for stage in STAGES:
            assert dag.get_task(stage.name).upstream_task_ids == set(stage.waits_for(streaming=True)), stage.name
    # the step's own --set, which wins over the run's overrides under --pipeline (a user's label.streaming=false
    # was refused as two values of one setting)
    assert _rendered(module.rlaif.get_task("label"))[-2:] == ["--set", "label.streaming=true"]
    assert module.rlaif_local.get_task("label").op_kwargs["launch_args"][-2:] == ["--set", "label.streaming=true"]
    assert "--set" not in _rendered(module.rlaif.get_task("generate"))


def test_a_run_conf_key_that_is_no_param_fails_the_task_at_once(dagbag, tmp_path):
    """A misspelt key (`override`) was ignored and the run went on with the defaults."""
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException
    from airflow.utils.state import DagRunState

    conf = {"config": "configs/tiny.yaml", "override": ["ppo.iterations=100"], "storage_root": f"file://{tmp_path}"}
    with pytest.raises(AirflowFailException, match="run conf 'override': not a param of this DAG .its params: "
                                                   "config, overrides, run_id, storage_root."):
        dagbag.get_dag("rlaif").get_task("generate").execute({"dag_run": SimpleNamespace(conf=conf)})
    dagrun = dagbag.get_dag("rlaif_local").test(run_conf=conf)
    generate = dagrun.get_task_instance("generate")
    assert dagrun.state == DagRunState.FAILED and generate.state == "failed" and generate.try_number == 1
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("code, retried", [(2, False), (1, True), (137, True)])
def test_a_pod_that_exits_with_a_user_error_is_not_retried(dagbag, monkeypatch, code, retried):
    """Exit code 2 (a bad config, a failed quality gate) fails the task for good: a retry would redo the stage's work
    and meet the same error. Any other failure keeps the cluster's retries."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
    from kubernetes.client import models as k8s

    def failed(self, pod, remote_pod, *args, **kwargs):
        raise AirflowException("Pod x returned a failure.")

    monkeypatch.setattr(KubernetesPodOperator, "cleanup", failed)
    task = dagbag.get_dag("rlaif").get_task("evaluate")
    terminated = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=code))
    remote = k8s.V1Pod(status=k8s.V1PodStatus(container_statuses=[k8s.V1ContainerStatus(
        name=task.base_container_name, state=terminated, image="i", image_id="", ready=False, restart_count=0)]))
    with pytest.raises(AirflowException) as raised:
        task.cleanup(None, remote)
    assert isinstance(raised.value, AirflowFailException) != retried


def test_dag_environment_values_are_read_or_refused(monkeypatch):
    """on/off read as yes/no (`on` was silently no), and a misspelt judge, which would size label's pod wrong, fails
    the import with one line (Airflow shows it as the DAG file's import error)."""
    import importlib.util

    def load(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        spec = importlib.util.spec_from_file_location("rlaif_dags_env", REPO / "dags/rlaif_dags.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    assert load(RLAIF_LABEL_STREAMING="on").STREAMING and not load(RLAIF_LABEL_STREAMING="Off").STREAMING
    with pytest.raises(ValueError, match="RLAIF_LABEL_STREAMING='maybe' is not a yes/no value"):
        load(RLAIF_LABEL_STREAMING="maybe")
    monkeypatch.setenv("RLAIF_LABEL_STREAMING", "0")
    with pytest.raises(ValueError, match="RLAIF_LABEL_JUDGE='OpenAI' is not one of embedding, hf, openai"):
        load(RLAIF_LABEL_JUDGE="OpenAI")


def test_no_secret_value_in_dags_or_pods(dagbag):
    from airflow.serialization.serialized_objects import DagSerialization

    for dag_id in dagbag.dag_ids:
        dag = dagbag.get_dag(dag_id)
        text = json.dumps(DagSerialization.to_dict(dag), default=str)
        assert "S3CR3T" not in text, dag_id
    for task in dagbag.get_dag("rlaif").tasks:
        assert "S3CR3T" not in str(task.build_pod_request_obj(context=None, dry_run=True))
    assert "S3CR3T" not in (REPO / "dags/rlaif_dags.py").read_text()


@pytest.mark.slow
def test_rlaif_local_fails_the_task_on_a_bad_config(dagbag, tmp_path):
    from airflow.utils.state import DagRunState

    conf = {"config": "configs/tiny.yaml", "overrides": ["ppo.iterationz=3"], "run_id": "bad",
            "storage_root": f"file://{tmp_path}/runs"}
    dagrun = dagbag.get_dag("rlaif_local").test(run_conf=conf)
    assert dagrun.state == DagRunState.FAILED
    generate = dagrun.get_task_instance("generate")
    assert generate.state == "failed" and generate.try_number == 1  # a user error is not retried
    assert dagrun.get_task_instance("label").state == "upstream_failed"
    assert not (tmp_path / "runs" / "bad" / "generate" / "manifest.json").exists()

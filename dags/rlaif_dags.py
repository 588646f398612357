"""Two Airflow DAGs generated from rlaif/graph.py (no stage list here: tasks and edges come from the graph).

- `rlaif`: each stage a KubernetesPodOperator running `rlaif launch <stage>` in the project image, with the same
  pod as the Kubeflow pipeline and the TrainJobs (rlaif/orchestration/pod.py; settings from $RLAIF_CLUSTER_CONFIG,
  label's GPU from $RLAIF_LABEL_JUDGE).
- `rlaif_local`: each stage a process on the worker (`$RLAIF_BIN launch <stage>`, run from $RLAIF_WORKDIR), for
  one GPU box with the LocalExecutor.

Only wiring: every task ends in `rlaif launch`, which checks the stage cache, starts torchrun or a multi-node job,
and fails with the stage's exit code. The Airflow environment needs this package importable (`pip install --no-deps
rlaif`: graph.py, cluster.py and pod.py use the standard library only)."""
from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, Param
from kubernetes.client import models as k8s

from rlaif.graph import topological_order
from rlaif.orchestration import cluster
from rlaif.orchestration.pod import SHM_VOLUME, pod_plan

SPEC = cluster.load(os.environ.get("RLAIF_CLUSTER_CONFIG"))
# Pods are sized when the DAG is parsed; the label judge of the config the runs will use decides whether label's pod
# gets a GPU (unset: it does). cluster.yaml's `stages` sizes override both.
JUDGE = os.environ.get("RLAIF_LABEL_JUDGE") or None
RUN_ID = "{{ params.run_id or dag_run.run_id }}"  # `rlaif launch` makes it a safe path segment
LOCK_OWNER = "airflow:{{ dag.dag_id }}:{{ dag_run.run_id }}:{{ task.task_id }}"  # a retry of a task takes its lock back

PARAMS = {
    "config": Param("configs/demo.yaml", type="string",
                    description="Config path/URL (paths resolve in the image's or worker's working directory), "
                                "or the YAML itself"),
    "overrides": Param([], type="array", items={"type": "string"},
                       description="KEY=VALUE overrides, as with `rlaif run --set`, e.g. ppo.iterations=100"),
    "run_id": Param("", type="string", description="Run directory name; empty: this DAG run's id (a retry resumes it)"),
    "storage_root": Param("", type="string", description="e.g. s3://bucket/rlaif; empty: the config's storage.root"),
}
DEFAULT_ARGS = {"owner": "rlaif", "retries": SPEC.retries, "retry_delay": timedelta(minutes=1),
                "retry_exponential_backoff": True}


def _doc(title: str) -> str:
    lines = [f"# {title}", "", "Stages (from `rlaif/graph.py`):", ""]
    lines += [f"- **{s.name}** <- {', '.join(s.inputs) or 'prompts'}: {s.description}" for s in topological_order()]
    lines += ["", "Params: `config`, `overrides`, `run_id`, `storage_root`. Outputs and the report live under "
              "`<storage_root>/<run_id>/`; the evaluate task's log ends with the win rate and the report's URL."]
    return "\n".join(lines)


def _launch_args(name: str) -> list[str]:
    """`rlaif launch` arguments, templated by Airflow: the same for a pod and for a local process."""
    return ["launch", name, "--config", "{{ params.config }}", "--set-json", "{{ params.overrides | tojson }}",
            "--run-id", RUN_ID, "--storage-root", "{{ params.storage_root }}"]


def _pod_task(stage) -> KubernetesPodOperator:
    """The Airflow translation of the stage's pod plan."""
    plan = pod_plan(stage, SPEC, JUDGE)
    resources = plan.resources()
    return KubernetesPodOperator(
        task_id=stage.name,
        name=plan.pod_name,
        doc_md=stage.description,
        image=plan.image,
        cmds=["rlaif"],
        arguments=_launch_args(stage.name),
        # V1EnvVars, not Airflow's Secret: that one has no `optional`, and the judge key's secret is optional.
        env_vars=[*(k8s.V1EnvVar(name=ref.env, value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(
            name=ref.secret, key=ref.key, optional=ref.optional))) for ref in plan.secret_env),
                  *(k8s.V1EnvVar(name=name, value=value) for name, value in sorted(plan.env.items())),
                  k8s.V1EnvVar(name="RLAIF_LOCK_OWNER", value=LOCK_OWNER)],
        container_resources=k8s.V1ResourceRequirements(requests=resources["requests"], limits=resources["limits"]),
        node_selector=plan.node_selector,
        tolerations=[k8s.V1Toleration(**t) for t in plan.toleration_list()],
        volumes=[k8s.V1Volume(name=SHM_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource(
            medium="Memory", size_limit=f"{plan.shm_gib}Gi"))],
        volume_mounts=[k8s.V1VolumeMount(name=SHM_VOLUME, mount_path="/dev/shm")],
        security_context=k8s.V1PodSecurityContext(run_as_user=plan.run_as_user, run_as_non_root=True),
        namespace=plan.namespace or None,
        service_account_name=plan.service_account or None,
        get_logs=True,
        on_finish_action="delete_pod",
    )


def run_launch(launch_args: list[str], lock_owner: str = "") -> None:
    """`$RLAIF_BIN launch <stage> ...` as a child process (an argv list, never a shell line), its output in the task
    log. Exit code 2 is a user error (bad config, missing input): failed without retries, which could not fix it."""
    import subprocess

    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    stage = launch_args[1]
    argv = [os.environ.get("RLAIF_BIN", "rlaif"), *launch_args]
    env = {**os.environ, **({"RLAIF_LOCK_OWNER": lock_owner} if lock_owner else {})}
    proc = subprocess.Popen(argv, cwd=os.environ.get("RLAIF_WORKDIR") or None, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in proc.stdout:
        print(line, end="", flush=True)
    if (code := proc.wait()) == 2:
        raise AirflowFailException(f"rlaif launch {stage}: user error (exit 2), see the line above; not retried")
    if code != 0:
        raise AirflowException(f"rlaif launch {stage} failed with exit code {code}")


def _local_task(stage) -> PythonOperator:
    return PythonOperator(
        task_id=stage.name,
        doc_md=stage.description,
        python_callable=run_launch,
        op_kwargs={"launch_args": _launch_args(stage.name), "lock_owner": LOCK_OWNER},  # each item rendered by Airflow
    )


def _build(dag_id: str, make_task, title: str, tags: list[str]) -> DAG:
    with DAG(dag_id=dag_id, schedule=os.environ.get("RLAIF_SCHEDULE") or None,
             start_date=datetime(2026, 1, 1, tzinfo=timezone.utc), catchup=False,
             params=PARAMS, default_args=DEFAULT_ARGS, tags=["rlaif", *tags], doc_md=_doc(title),
             max_active_runs=1, render_template_as_native_obj=False) as dag:
        tasks = {}
        for stage in topological_order():
            tasks[stage.name] = make_task(stage)
            for dep in stage.inputs:
                tasks[dep] >> tasks[stage.name]
    return dag


rlaif = _build("rlaif", _pod_task, "RLAIF pipeline on Kubernetes (one pod per stage)", ["kubernetes"])
rlaif_local = _build("rlaif_local", _local_task, "RLAIF pipeline as local processes on this worker", ["local"])

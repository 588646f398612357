"""Two Airflow DAGs generated from rlaif/graph.py (no stage list here: tasks and edges come from the graph).

- `rlaif`: each stage a KubernetesPodOperator running `rlaif launch <stage>` in the project image, with the same
  pod as the Kubeflow pipeline and the TrainJobs (rlaif/orchestration/pod.py; settings from $RLAIF_CLUSTER_CONFIG,
  label's GPU from $RLAIF_LABEL_JUDGE).

With $RLAIF_LABEL_STREAMING=1 (label.streaming), label has no edge from generate in either DAG: the two tasks run at
once and label's launch streams generate's shards as they land.
- `rlaif_local`: each stage a process on the worker (`$RLAIF_BIN launch <stage>`, run from $RLAIF_WORKDIR), for
  one GPU box with the LocalExecutor. Its `aws_conn_id` param (default $RLAIF_AWS_CONN_ID) names an Airflow `aws`
  connection whose keys, endpoint and region reach that process's environment only.

Each stage task publishes the asset `rlaif://stages/<stage>` (ASSETS below) when it succeeds; in `rlaif_local` the
event's extra holds the manifest's URL and digest and the run id. A DAG with `schedule=[Asset("rlaif://stages/ppo")]`
runs on every new policy (dags/rlaif_on_new_policy.py).

Only wiring: every task ends in `rlaif launch`, which checks the stage cache, starts torchrun or a multi-node job,
and fails with the stage's exit code. The Airflow environment needs this package importable (`pip install --no-deps
rlaif`: graph.py, cluster.py and pod.py use the standard library only)."""
from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, Asset, Param
from kubernetes.client import models as k8s

from rlaif.graph import topological_order
from rlaif.orchestration import cluster
from rlaif.orchestration.pod import SHM_VOLUME, flag_from_env, judge_from_env, pod_plan

SPEC = cluster.load(os.environ.get("RLAIF_CLUSTER_CONFIG"))
# Pods are sized when the DAG is parsed; the label judge of the config the runs will use decides whether label's pod
# gets a GPU (unset: it does). cluster.yaml's `stages` sizes override both.
JUDGE = judge_from_env(os.environ.get("RLAIF_LABEL_JUDGE"))
# The graph's streaming edges (label <- generate) are dropped and the streaming stage launched with streaming on.
STREAMING = flag_from_env("RLAIF_LABEL_STREAMING", os.environ.get("RLAIF_LABEL_STREAMING"))
RUN_ID = "{{ params.run_id }}"  # checked by `rlaif launch`; empty: this DAG run's id below
DAG_RUN_ID = "{{ dag_run.run_id }}"  # `rlaif launch --default-run-id` makes it a safe path segment
LOCK_OWNER = "airflow:{{ dag.dag_id }}:{{ dag_run.run_id }}:{{ task.task_id }}"  # a retry of a task takes its lock back

PARAMS = {
    "config": Param("configs/demo.yaml", type="string", minLength=1,
                    description="Config path/URL (paths resolve in the image's or worker's working directory), "
                                "or the YAML itself"),
    "overrides": Param([], type="array", items={"type": "string"},
                       description="KEY=VALUE overrides, as with `rlaif run --set`, e.g. ppo.iterations=100"),
    "run_id": Param("", type="string", description="Run directory name; empty: this DAG run's id (a retry resumes it)"),
    "storage_root": Param("", type="string", description="e.g. s3://bucket/rlaif; empty: the config's storage.root"),
}
# Only the local DAG: a pod would get the connection's secret in its spec (visible to anyone who can read pods, and
# in the rendered template), so pods keep reading S3 credentials from a Kubernetes secret (cluster.yaml `secrets`).
LOCAL_PARAMS = {**PARAMS, "aws_conn_id": Param(
    os.environ.get("RLAIF_AWS_CONN_ID", ""), type="string",
    description="Airflow connection (type aws: login = access key id, password = secret key, extra endpoint_url and "
                "region_name) for s3:// storage; empty: the worker's AWS_* environment")}
# Static URIs (Airflow registers assets when it parses the DAG); the run's concrete manifest is in each event's extra.
# The name is the URI, so a consumer's `Asset("rlaif://stages/ppo")` is this very asset.
ASSETS = {s.name: Asset(f"rlaif://stages/{s.name}") for s in topological_order()}
DEFAULT_ARGS = {"owner": "rlaif", "retries": SPEC.retries, "retry_delay": timedelta(minutes=1),
                "retry_exponential_backoff": True}


def _doc(title: str) -> str:
    lines = [f"# {title}", "", "Stages (from `rlaif/graph.py`):", ""]
    lines += [f"- **{s.name}** <- {', '.join(s.inputs) or 'prompts'}: {s.description}" for s in topological_order()]
    lines += ["", "Params: `config`, `overrides`, `run_id`, `storage_root`. Outputs and the report live under "
              "`<storage_root>/<run_id>/`; the evaluate task's log ends with the win rate and the report's URL."]
    return "\n".join(lines)


def _launch_args(stage) -> list[str]:
    """`rlaif launch` arguments, templated by Airflow: the same for a pod and for a local process."""
    # After the run's overrides, and winning over them (--pipeline): this DAG has no edge for label to wait on.
    streams = ["--set", f"{stage.name}.streaming=true"] if STREAMING and stage.streams_from else []
    return ["launch", stage.name, "--config", "{{ params.config }}", "--set-json", "{{ params.overrides | tojson }}",
            "--run-id", RUN_ID, "--default-run-id", DAG_RUN_ID, "--storage-root", "{{ params.storage_root }}",
            "--pipeline", *streams]


class LaunchPodOperator(KubernetesPodOperator):
    """A stage's pod: refuses run conf keys that are not the DAG's params before it starts one, and fails without
    retries when `rlaif launch` exits with code 2 (a user error: a bad config, a missing input, a failed quality gate,
    which a retry would meet again after redoing the stage's work)."""

    def execute(self, context):
        refuse_unknown_conf(context, PARAMS)
        return super().execute(context)

    def cleanup(self, pod, remote_pod, *args, **kwargs):
        from airflow.sdk.exceptions import AirflowException, AirflowFailException

        try:
            return super().cleanup(pod, remote_pod, *args, **kwargs)
        except AirflowFailException:
            raise
        except AirflowException as exc:
            if exit_code(remote_pod, self.base_container_name) == 2:
                raise AirflowFailException(f"rlaif launch {self.task_id}: user error (exit 2), see the pod log "
                                           "above; not retried") from exc
            raise


def exit_code(remote_pod, container: str) -> int | None:
    """The exit code of the pod's `container`, None while it has none."""
    statuses = (remote_pod.status.container_statuses if remote_pod and remote_pod.status else None) or []
    status = next((s for s in statuses if s.name == container), None)
    terminated = status and status.state and status.state.terminated
    return terminated.exit_code if terminated else None


def refuse_unknown_conf(context, params: dict) -> None:
    """A run's conf key that is no param of the DAG (`override` for `overrides`) would be ignored and the run go on
    with the defaults: the task fails in one line instead, without retries."""
    from airflow.sdk.exceptions import AirflowFailException

    dag_run = context.get("dag_run")
    unknown = sorted(set(getattr(dag_run, "conf", None) or {}) - set(params))
    if unknown:
        raise AirflowFailException(f"run conf {', '.join(map(repr, unknown))}: not a param of this DAG (its params: "
                                   f"{', '.join(params)}); trigger it again without it")


def _pod_task(stage) -> KubernetesPodOperator:
    """The Airflow translation of the stage's pod plan."""
    plan = pod_plan(stage, SPEC, JUDGE)
    resources = plan.resources()
    return LaunchPodOperator(
        task_id=stage.name,
        name=plan.pod_name,
        doc_md=stage.description,
        image=plan.image,
        cmds=["rlaif"],
        arguments=_launch_args(stage),
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
        # The event has no extra here: the digest is known only inside the pod, and reading it back would add KPO's
        # XCom sidecar to every pod. Consumers read <storage_root>/<run_id>/<stage>/manifest.json.
        outlets=[ASSETS[stage.name]],
    )


def run_launch(launch_args: list[str], lock_owner: str = "", aws_conn_id: str = "", outlet_events=None,
               dag_run=None) -> None:
    """`$RLAIF_BIN launch <stage> ...` as a child process (an argv list, never a shell line), its output in the task
    log. Exit code 2 is a user error (bad config, missing input): failed without retries, which could not fix it.
    On success the stage's manifest URL and digest become the extra of its asset event."""
    import json
    import subprocess
    import tempfile

    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    refuse_unknown_conf({"dag_run": dag_run}, LOCAL_PARAMS)
    stage = launch_args[1]
    aws = aws_env(aws_conn_id)
    # A connection's keys replace the worker's whole identity: no session token or profile of the worker mixed in.
    env = {k: v for k, v in os.environ.items() if not ("AWS_ACCESS_KEY_ID" in aws and k in AWS_SESSION_VARS)}
    env.update(aws, **({"RLAIF_LOCK_OWNER": lock_owner} if lock_owner else {}))
    with tempfile.TemporaryDirectory(prefix="rlaif-task-") as tmp:
        out = os.path.join(tmp, "manifest.json")
        argv = [os.environ.get("RLAIF_BIN", "rlaif"), *launch_args, "--manifest-out", out]
        proc = subprocess.Popen(argv, cwd=os.environ.get("RLAIF_WORKDIR") or None, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            print(line, end="", flush=True)
        if (code := proc.wait()) == 2:
            raise AirflowFailException(f"rlaif launch {stage}: user error (exit 2), see the line above; not retried")
        if code != 0:
            raise AirflowException(f"rlaif launch {stage} failed with exit code {code}")
        with open(out, encoding="utf-8") as f:
            done = json.load(f)
    if outlet_events is not None:
        outlet_events[ASSETS[stage]].extra = done
    print(f"[{stage}] manifest {done['url']} digest {done['digest']}", flush=True)


AWS_SESSION_VARS = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE")


def aws_env(conn_id: str) -> dict[str, str]:
    """The AWS_* variables of an Airflow `aws` connection, for the child's environment only (Airflow masks the
    secret in task logs; nothing here prints it). No connection named: none. A missing or malformed connection fails
    the task in one line, without retries."""
    if not conn_id:
        return {}
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowFailException, AirflowNotFoundException

    try:
        conn = Connection.get(conn_id)
    except AirflowNotFoundException:
        raise AirflowFailException(f"aws_conn_id {conn_id!r}: no such Airflow connection (create it with `airflow "
                                   "connections add ... --conn-type aws`, or clear the param)") from None
    if conn.conn_type != "aws":
        raise AirflowFailException(f"aws_conn_id {conn_id!r}: connection type is {conn.conn_type!r}, expected 'aws'")
    if bool(conn.login) != bool(conn.password):
        raise AirflowFailException(f"aws_conn_id {conn_id!r}: set both login (access key id) and password (secret "
                                   "access key), or neither (the worker's own credentials)")
    extra = conn.extra_dejson
    unknown = sorted(set(extra) - {"endpoint_url", "region_name"})
    if unknown:
        raise AirflowFailException(f"aws_conn_id {conn_id!r}: unsupported extra {unknown} (rlaif reads endpoint_url "
                                   "and region_name)")
    pairs = {"AWS_ACCESS_KEY_ID": conn.login, "AWS_SECRET_ACCESS_KEY": conn.password,
             "AWS_ENDPOINT_URL": extra.get("endpoint_url"), "AWS_DEFAULT_REGION": extra.get("region_name")}
    return {name: str(value) for name, value in pairs.items() if value}


def _local_task(stage) -> PythonOperator:
    return PythonOperator(
        task_id=stage.name,
        doc_md=stage.description,
        python_callable=run_launch,
        # each item rendered by Airflow; the connection is resolved when the task runs, never rendered
        op_kwargs={"launch_args": _launch_args(stage), "lock_owner": LOCK_OWNER,
                   "aws_conn_id": "{{ params.aws_conn_id }}"},
        outlets=[ASSETS[stage.name]],
    )


def _build(dag_id: str, make_task, title: str, tags: list[str], params: dict) -> DAG:
    with DAG(dag_id=dag_id, schedule=os.environ.get("RLAIF_SCHEDULE") or None,
             start_date=datetime(2026, 1, 1, tzinfo=timezone.utc), catchup=False,
             params=params, default_args=DEFAULT_ARGS, tags=["rlaif", *tags], doc_md=_doc(title),
             max_active_runs=1, render_template_as_native_obj=False) as dag:
        tasks = {}
        for stage in topological_order():
            tasks[stage.name] = make_task(stage)
            for dep in stage.waits_for(STREAMING):
                tasks[dep] >> tasks[stage.name]
    return dag


rlaif = _build("rlaif", _pod_task, "RLAIF pipeline on Kubernetes (one pod per stage)", ["kubernetes"], PARAMS)
rlaif_local = _build("rlaif_local", _local_task, "RLAIF pipeline as local processes on this worker", ["local"],
                     LOCAL_PARAMS)

"""Multi-node training stages as Kubeflow jobs: a TrainJob (Kubeflow Trainer v2) or a PyTorchJob (the older
training operator), generated from graph.py and the cluster settings, created by the pipeline step, watched until
it ends, and reported with its status. Every pod runs the same entrypoint as a single-node stage under torchrun."""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import replace

from rlaif.config import PipelineConfig
from rlaif.errors import StageFailed, Terminated, UserError, one_line
from rlaif.graph import Stage
from rlaif.orchestration.cluster import ClusterSpec, load
from rlaif.orchestration.pod import SHM_VOLUME, PodPlan, pod_plan
from rlaif.stages import common

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
API = {  # group, version, plural, terminal conditions (success, failure)
    "trainjob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "Complete", "Failed"),
    "pytorchjob": ("kubeflow.org", "v1", "pytorchjobs", "Succeeded", "Failed"),
}
OWNER_KEYS = ("rlaif/run-dir", "rlaif/stage")  # annotations: the exact run directory and stage a job is for
POD_LABEL = {"trainjob": "jobset.sigs.k8s.io/jobset-name", "pytorchjob": "training.kubeflow.org/job-name"}
TRANSIENT_STATUS = (429, 500, 502, 503, 504)
API_PATIENCE_S = 300.0  # how long the API may fail in a row (a control-plane upgrade) before the step gives up
START_GRACE_S = 300.0  # how long a container may fail to start (a registry hiccup passes; a wrong image does not)
START_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                "CreateContainerError")
REPLACE_PATIENCE_S = 300.0  # how long a deleted job of an earlier attempt and its pods may take to go


class JobError(Exception):
    """The job could not be watched or replaced (the API kept failing, an old job would not go): the message says
    what is left behind."""


def job_name(stage: Stage, cfg: PipelineConfig) -> str:
    """An RFC 1035 name, the same for every attempt of a run's stage (a retried step finds the job it created) and
    distinct across runs: a short hash of the run's directory follows a readable cut of its id, since ids that differ
    in case or punctuation (`Exp_1`, `exp-1`) or only past a length limit would otherwise share one job. Short
    enough for the names the operators derive from it (`<name>-master-0`, a JobSet's `<name>-node-0-0`)."""
    readable = re.sub(r"[^a-z0-9]+", "-", cfg.run_id.lower()).strip("-")[:20].strip("-")
    return "-".join(part for part in ("rlaif", readable, _run_hash(cfg), stage.name.replace("_", "-")) if part)


def _run_hash(cfg: PipelineConfig) -> str:
    return hashlib.sha256(common.run_url(cfg).encode()).hexdigest()[:8]


def label_value(text: str) -> str:
    """`text` as a Kubernetes label value: at most 63 characters of [A-Za-z0-9_.-], alphanumeric at both ends."""
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63])


def job_manifest(stage: Stage, cfg: PipelineConfig, config_url: str, nodes: int, spec: ClusterSpec,
                 namespace: str, cache_checked: str = "") -> dict:
    """The TrainJob or PyTorchJob custom resource for a stage on `nodes` pods, each pod from the stage's pod plan.
    `cache_checked`: the cache key its launcher found no valid output for (a miss, a damaged output, --rerun), so
    the pods run the stage without checking the cache again, and only with the settings the launcher checked."""
    plan = pod_plan(stage, spec, cfg.label.pod_judge)
    if cache_checked:
        plan = replace(plan, env={**plan.env, "RLAIF_CACHE_CHECKED": cache_checked,
                                  common.LAUNCHED_CONFIG: common.launched_config(cfg)})
    nproc = plan.gpus or getattr(cfg, stage.name).nproc
    entry = ["-m", "rlaif", *stage.argv(config_url)[1:]]
    metadata = {"name": job_name(stage, cfg), "namespace": namespace,
                "labels": {"app.kubernetes.io/part-of": "rlaif", "rlaif/run-id": label_value(cfg.run_id),
                           "rlaif/stage": stage.name},
                # The exact run: a job found under this name is this stage's of this run before it is reused.
                "annotations": dict(zip(OWNER_KEYS, (common.run_url(cfg), stage.name)))}
    if spec.multinode_api == "trainjob":
        return _trainjob(plan, metadata, ["torchrun", *entry], nodes, nproc, spec.trainjob_runtime)
    # The operator sets RANK (the node's rank), WORLD_SIZE (nodes), MASTER_ADDR and MASTER_PORT on every replica.
    command = ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={nproc}", "--node_rank=$(RANK)",
               "--master_addr=$(MASTER_ADDR)", "--master_port=$(MASTER_PORT)", *entry]
    replica = {"restartPolicy": "OnFailure", "template": {"spec": plan.pod_spec("pytorch", command)}}
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata,
        "spec": {"runPolicy": {"backoffLimit": plan.retries},
                 "pytorchReplicaSpecs": {"Master": {"replicas": 1, **replica},
                                         "Worker": {"replicas": nodes - 1, **replica}}},
    }


def _trainjob(plan: PodPlan, metadata: dict, command: list[str], nodes: int, nproc: int, runtime: str) -> dict:
    """A TrainJob: the trainer carries image, command, resources and env; scheduling, /dev/shm and the service account
    go through podTemplateOverrides on the runtime's `node` job (the runtime's template sets its security context).
    The torch runtime sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and PET_MASTER_ADDR/PORT for torchrun."""
    overrides = {"nodeSelector": dict(plan.node_selector), "tolerations": plan.toleration_list(),
                 "volumes": [plan.shm_volume()],
                 "containers": [{"name": "node", "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]}]}
    if plan.service_account:
        overrides["serviceAccountName"] = plan.service_account
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": metadata,
        "spec": {
            "runtimeRef": {"name": runtime},
            "trainer": {"image": plan.image, "command": command, "numNodes": nodes, "numProcPerNode": nproc,
                        "resourcesPerNode": plan.resources(), "env": plan.env_list()},
            "podTemplateOverrides": [{"targetJobs": [{"name": "node"}], "spec": overrides}],
        },
    }


def job_state(job: dict, api: str) -> tuple[str, str]:
    """("running" | "succeeded" | "failed", message) from the job's status conditions."""
    _, _, _, done, failed = API[api]
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == done:
            return "succeeded", cond.get("message", "")
        if cond.get("type") == failed:
            return "failed", cond.get("message") or cond.get("reason", "")
    return "running", ""


def wait(client, api: str, namespace: str, name: str, poll_s: float = 15.0, timeout_s: float | None = None,
         pods=None, start_timeout_s: float = 0) -> tuple[str, str]:
    """Polls the job until it succeeds or fails (or the timeout passes); `client` is a kubernetes CustomObjectsApi.
    With `pods` (a CoreV1Api) the job's pods are watched too: a pod that cannot start (an image that does not pull, a
    missing secret key) for START_GRACE_S, or that no node takes for `start_timeout_s` (0: no limit), ends the wait
    as "stuck" with Kubernetes' reason, where the job itself would wait for good."""
    from kubernetes.client.exceptions import ApiException

    plural = API[api][2]
    start, first_seen = time.time(), {}
    while True:
        try:
            job = read_job(client, api, namespace, name)
        except ApiException as exc:
            return "failed", _read_failure(exc, plural, namespace)
        state, message = job_state(job, api)
        if state != "running":
            return state, message
        if timeout_s is not None and time.time() - start > timeout_s:
            return "failed", f"still running after {timeout_s:.0f}s"
        if pods is not None:
            problem = pod_problem(pods, api, namespace, name, first_seen, start_timeout_s)
            if problem is None:  # the account may not list pods: wait on the job alone
                pods = None
            elif problem:
                return "stuck", problem
        time.sleep(poll_s)


def read_job(client, api: str, namespace: str, name: str) -> dict:
    """The job as the API has it now, through call()'s retries."""
    group, version, plural, _, _ = API[api]
    return call(f"read {plural} {namespace}/{name}",
                lambda: client.get_namespaced_custom_object(group, version, namespace, plural, name))


def _read_failure(exc, plural: str, namespace: str) -> str:
    if exc.status == 404:
        return ("it was deleted while this step waited on it (kubectl delete, a namespace cleanup); a retried step "
                "starts it again")
    if exc.status in (401, 403):
        raise UserError(f"the step's service account may not read {plural} in {namespace} ({exc.status} "
                        f"{exc.reason}): grant it get, create and delete on {plural} (service_account in the cluster "
                        "settings)") from None
    return f"reading it failed: {exc.status} {exc.reason}"


def call(what: str, request):
    """request() against the Kubernetes API, tried again while the API fails in ways that pass (an API server
    restarting or throttling, a dropped connection) for up to API_PATIENCE_S; any other ApiException is raised."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    deadline, delay = time.time() + API_PATIENCE_S, 1.0
    while True:
        try:
            return request()
        except ApiException as exc:
            if exc.status not in TRANSIENT_STATUS:
                raise
            problem = f"{exc.status} {exc.reason}"
        except (OSError, urllib3.exceptions.HTTPError) as exc:
            problem = one_line(exc, 200) or type(exc).__name__
        if time.time() >= deadline:
            raise JobError(f"the Kubernetes API failed to {what} for {API_PATIENCE_S:.0f}s (last: {problem}); a job "
                           "already created is left running, and a retried step waits on it")
        time.sleep(delay)
        delay = min(2 * delay, 30.0)


def pod_problem(pods, api: str, namespace: str, name: str, first_seen: dict, start_timeout_s: float) -> str | None:
    """Why the job's pods will not start on their own, once that has lasted its grace; "" while nothing has; None
    when they cannot be listed (an account without `list` on pods). `first_seen`: when each problem was first seen."""
    from kubernetes.client.exceptions import ApiException

    selector = f"{POD_LABEL[api]}={name}"
    try:  # the body is read inside the retry: a connection dropped while reading it is retried too
        body = call(f"list the pods of {name}", lambda: pods.list_namespaced_pod(
            namespace, label_selector=selector, _preload_content=False).data)
        listed = json.loads(body)
    except ApiException as exc:  # the job's own status still ends the wait
        hint = " (the step's service account needs list on pods)" if exc.status in (401, 403) else ""
        print(f"cannot list the pods of {name} ({exc.status} {exc.reason}): pods that never start will not be "
              f"reported{hint}", flush=True)
        return None
    except ValueError:
        print(f"cannot list the pods of {name} (an answer that is not JSON): pods that never start will not be "
              "reported", flush=True)
        return None
    now, current = time.time(), {}
    for pod in listed.get("items") or []:
        for key, (problem, grace) in _start_problems(pod, start_timeout_s).items():
            current[key] = first_seen.get(key, now)
            if grace and now - current[key] >= grace:
                return problem
    first_seen.clear()
    first_seen.update(current)  # a problem that went away starts its grace again if it comes back
    return ""


def _start_problems(pod: dict, start_timeout_s: float) -> dict[str, tuple[str, float]]:
    pod_name = (pod.get("metadata") or {}).get("name", "?")
    status = pod.get("status") or {}
    problems = {}
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in START_ERRORS:
            detail = one_line(waiting.get("message", ""))
            problems[f"{pod_name}/{container.get('name')}"] = (
                f"pod {pod_name} cannot start {container.get('name')} for {START_GRACE_S:.0f}s: "
                f"{waiting['reason']}{': ' + detail if detail else ''}", START_GRACE_S)
    for condition in status.get("conditions") or []:
        if (condition.get("type"), condition.get("status"), condition.get("reason")) == (
                "PodScheduled", "False", "Unschedulable"):
            detail = one_line(condition.get("message", ""))
            problems[f"{pod_name}/scheduling"] = (
                f"pod {pod_name} found no node for {start_timeout_s:.0f}s: {detail} (multinode_start_timeout_s in "
                "the cluster settings)", start_timeout_s)
    return problems


def wait_or_stop(client, api: str, namespace: str, name: str, poll_s: float = 15.0, pods=None,
                 start_timeout_s: float = 0) -> tuple[str, str]:
    """wait(); a launcher stopped meanwhile (SIGTERM: a cancelled run, a deleted step pod, an evicted one; Ctrl-C)
    deletes the job and so its pods, which would otherwise train on, holding their GPUs, with no one waiting for
    them; a retried step then starts a new job, which resumes from the stage's last checkpoint. (A launcher killed
    outright leaves the job, which its retried step finds and waits on.) A job whose pods cannot start is deleted
    too: its pods would hold what they got, and a retried step would wait on it again."""
    try:
        state, message = wait(client, api, namespace, name, poll_s, pods=pods, start_timeout_s=start_timeout_s)
    except (KeyboardInterrupt, Terminated):
        _delete(client, api, namespace, name, "stopped")
        raise
    if state == "stuck":
        _delete(client, api, namespace, name, "stuck")
        return "failed", message
    return state, message


def _delete(client, api: str, namespace: str, name: str, why: str) -> None:
    group, version, plural, _, _ = API[api]
    try:
        client.delete_namespaced_custom_object(group, version, namespace, plural, name,
                                               propagation_policy="Background")
        print(f"{why}: deleted {plural} {namespace}/{name} and its pods", flush=True)
    except Exception as exc:  # noqa: BLE001 - the step ends anyway; the user is told what is left running
        print(f"{why}: could not delete {plural} {namespace}/{name} ({exc}): delete it with kubectl", flush=True)


def create_or_reuse(client, api: str, body: dict) -> None:
    """Creates the job; a retried pipeline step finds the job it created before, still running, and waits on it
    instead. An ended one is replaced: a failed one, and a succeeded one too, since its launcher found no valid
    output of this config (another config's run, a damaged output, --rerun)."""
    from kubernetes.client.exceptions import ApiException

    group, version, plural, _, _ = API[api]
    ns, name, kind = body["metadata"]["namespace"], body["metadata"]["name"], body["kind"]

    def create():
        try:
            call(f"create {plural} {ns}/{name}",
                 lambda: client.create_namespaced_custom_object(group, version, ns, plural, body))
        except ApiException as exc:
            if exc.status != 409:
                raise UserError(f"could not create {kind} {ns}/{name}: {exc.status} {exc.reason}") from None
            return False
        return True

    if create():
        print(f"created {kind} {ns}/{name}", flush=True)
        return
    job = read_job(client, api, ns, name)
    if owner(job) != owner(body):  # another run's or stage's job: never wait on it, never delete it
        run_dir, stage = owner(job).values()
        raise UserError(f"{kind} {ns}/{name} exists but is not this stage's of this run (it is for "
                        f"{run_dir or 'no rlaif run'}, stage {stage}): delete it (kubectl delete {plural} -n {ns} "
                        f"{name}) or use another namespace")
    if job_state(job, api)[0] == "running":
        print(f"{kind} {ns}/{name} exists (an earlier attempt): waiting on it", flush=True)
        return
    # Ended in an earlier attempt: start over once the old one and its pods are gone (Foreground: the job goes last).
    try:
        call(f"delete {plural} {ns}/{name}", lambda: client.delete_namespaced_custom_object(
            group, version, ns, plural, name, propagation_policy="Foreground"))
    except ApiException as exc:
        if exc.status != 404:  # 404: gone already (a delete whose answer was lost, retried)
            raise UserError(f"could not delete {kind} {ns}/{name} of an earlier attempt: {exc.status} "
                            f"{exc.reason}") from None
    _wait_gone(client, api, ns, name)
    if not create():
        raise JobError(f"{kind} {ns}/{name} was created again by someone else while it was replaced")
    print(f"replaced {kind} {ns}/{name} (it had ended in an earlier attempt)", flush=True)


def _wait_gone(client, api: str, namespace: str, name: str) -> None:
    from kubernetes.client.exceptions import ApiException

    plural = API[api][2]
    deadline = time.time() + REPLACE_PATIENCE_S
    while time.time() < deadline:
        try:
            read_job(client, api, namespace, name)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        time.sleep(2)
    raise JobError(f"{plural} {namespace}/{name} of an earlier attempt was deleted but is still there after "
                   f"{REPLACE_PATIENCE_S:.0f}s (its pods still terminating, or a finalizer): delete it (kubectl delete "
                   f"{plural} -n {namespace} {name}) and retry")


def owner(job: dict) -> dict:
    """The run directory and stage a job's annotations name (None where it has none: not made by rlaif)."""
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    return {key: annotations.get(key) for key in OWNER_KEYS}


def run_multinode(stage: Stage, cfg: PipelineConfig, config_url: str, nodes: int, config_hash: str) -> None:
    """Called from inside a pipeline pod: create the job for this stage and wait for it."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException as exc:
        raise UserError(f"{stage.name}.nodes={nodes}: cannot reach the Kubernetes API from this pod ({exc}): the step "
                        "needs its service account's token (automountServiceAccountToken)") from None
    spec = load()
    namespace = spec.namespace
    if not namespace and os.path.exists(SERVICE_ACCOUNT_NAMESPACE):
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
            namespace = f.read().strip()
    body = job_manifest(stage, cfg, config_url, nodes, spec, namespace or "default", cache_checked=config_hash)
    api, kind, name = client.CustomObjectsApi(), body["kind"], body["metadata"]["name"]
    try:
        create_or_reuse(api, spec.multinode_api, body)
        state, message = wait_or_stop(api, spec.multinode_api, body["metadata"]["namespace"], name,
                                      pods=client.CoreV1Api(), start_timeout_s=spec.multinode_start_timeout_s)
    except JobError as exc:
        state, message = "failed", str(exc)
    if state != "succeeded":  # its pods' output is in their logs, not above this line: it says where
        labels = body["metadata"]["labels"]
        selector = f"rlaif/run-id={labels['rlaif/run-id']},rlaif/stage={stage.name}"
        raise StageFailed(stage.name, 1, f"stage '{stage.name}' failed: {kind} {name}: {message} (its pods' output: "
                                         f"kubectl logs -n {body['metadata']['namespace']} -l {selector})")

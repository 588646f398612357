"""Multi-node training stages as Kubeflow jobs: a TrainJob (Kubeflow Trainer v2) or a PyTorchJob (the older
training operator), generated from graph.py and the cluster settings, created by the pipeline step, watched until
it ends, and reported with its status. Every pod runs the same entrypoint as a single-node stage under torchrun."""
from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import replace

from rlaif.config import PipelineConfig
from rlaif.errors import StageFailed, Terminated, UserError
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


def wait(client, api: str, namespace: str, name: str, poll_s: float = 15.0,
         timeout_s: float | None = None) -> tuple[str, str]:
    """Polls the job until it succeeds or fails (or the timeout passes); `client` is a kubernetes CustomObjectsApi."""
    group, version, plural, _, _ = API[api]
    start = time.time()
    while True:
        job = client.get_namespaced_custom_object(group, version, namespace, plural, name)
        state, message = job_state(job, api)
        if state != "running":
            return state, message
        if timeout_s is not None and time.time() - start > timeout_s:
            return "failed", f"still running after {timeout_s:.0f}s"
        time.sleep(poll_s)


def wait_or_stop(client, api: str, namespace: str, name: str, poll_s: float = 15.0) -> tuple[str, str]:
    """wait(); a launcher stopped meanwhile (SIGTERM: a cancelled run, a deleted step pod, an evicted one; Ctrl-C)
    deletes the job and so its pods, which would otherwise train on, holding their GPUs, with no one waiting for
    them; a retried step then starts a new job, which resumes from the stage's last checkpoint. (A launcher killed
    outright leaves the job, which its retried step finds and waits on.)"""
    try:
        return wait(client, api, namespace, name, poll_s)
    except (KeyboardInterrupt, Terminated):
        group, version, plural, _, _ = API[api]
        try:
            client.delete_namespaced_custom_object(group, version, namespace, plural, name,
                                                   propagation_policy="Background")
            print(f"stopped: deleted {plural} {namespace}/{name} and its pods", flush=True)
        except Exception as exc:  # noqa: BLE001 - the stop goes on; the user is told what is left running
            print(f"could not delete {plural} {namespace}/{name} ({exc}): delete it with kubectl", flush=True)
        raise


def create_or_reuse(client, api: str, body: dict) -> None:
    """Creates the job; a retried pipeline step finds the job it created before, still running, and waits on it
    instead. An ended one is replaced: a failed one, and a succeeded one too, since its launcher found no valid
    output of this config (another config's run, a damaged output, --rerun)."""
    from kubernetes.client.exceptions import ApiException

    group, version, plural, _, _ = API[api]
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        client.create_namespaced_custom_object(group, version, ns, plural, body)
        print(f"created {body['kind']} {ns}/{name}", flush=True)
    except ApiException as exc:
        if exc.status != 409:
            raise UserError(f"could not create {body['kind']} {ns}/{name}: {exc.status} {exc.reason}") from None
        job = client.get_namespaced_custom_object(group, version, ns, plural, name)
        if owner(job) != owner(body):  # another run's or stage's job: never wait on it, never delete it
            run_dir, stage = owner(job).values()
            raise UserError(f"{body['kind']} {ns}/{name} exists but is not this stage's of this run (it is for "
                            f"{run_dir or 'no rlaif run'}, stage {stage}): delete it (kubectl delete {plural} -n {ns} "
                            f"{name}) or use another namespace") from None
        if job_state(job, api)[0] != "running":  # ended in an earlier attempt: start over
            client.delete_namespaced_custom_object(group, version, ns, plural, name)
            time.sleep(5)
            client.create_namespaced_custom_object(group, version, ns, plural, body)
            print(f"replaced {body['kind']} {ns}/{name} (it had ended in an earlier attempt)", flush=True)
            return
        print(f"{body['kind']} {ns}/{name} exists (an earlier attempt): waiting on it", flush=True)


def owner(job: dict) -> dict:
    """The run directory and stage a job's annotations name (None where it has none: not made by rlaif)."""
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    return {key: annotations.get(key) for key in OWNER_KEYS}


def run_multinode(stage: Stage, cfg: PipelineConfig, config_url: str, nodes: int, config_hash: str) -> None:
    """Called from inside a pipeline pod: create the job for this stage and wait for it."""
    from kubernetes import client, config

    config.load_incluster_config()
    spec = load()
    namespace = spec.namespace
    if not namespace and os.path.exists(SERVICE_ACCOUNT_NAMESPACE):
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
            namespace = f.read().strip()
    body = job_manifest(stage, cfg, config_url, nodes, spec, namespace or "default", cache_checked=config_hash)
    api = client.CustomObjectsApi()
    create_or_reuse(api, spec.multinode_api, body)
    state, message = wait_or_stop(api, spec.multinode_api, body["metadata"]["namespace"], body["metadata"]["name"])
    if state != "succeeded":
        print(f"{body['kind']} {body['metadata']['name']} failed: {message}", flush=True)
        raise StageFailed(stage.name, 1)

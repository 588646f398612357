"""One stage's pod, specified once: image, CPU/memory/GPUs, node selectors, tolerations, /dev/shm, security context,
secrets and environment. The KFP pipeline, the Airflow DAG and the TrainJob/PyTorchJob builder translate a `PodPlan`
into their own API and add only their command; `tests/orchestration/test_pod_plan.py` and the Airflow suite check
that all three render the same pod.

Standard library only: the Airflow DAG file imports it."""
from __future__ import annotations

from dataclasses import dataclass

from rlaif.graph import Stage
from rlaif.orchestration.cluster import ClusterSpec, Toleration

SHM_VOLUME = "dshm"
# Judges that run no model inside the pod: rules and reference are programs, openai calls an HTTP endpoint, and
# `served` is an hf judge whose model runs in an `rlaif serve` service (JudgeSettings.pod_judge).
JUDGES_WITHOUT_MODEL = ("openai", "rules", "reference", "served")
POD_JUDGES = ("embedding", "hf", *JUDGES_WITHOUT_MODEL)
# On a pod sized without a GPU for such a judge: that judge, so launch can refuse a runtime config (the KFP `judge`
# parameter, a config's label.judge) whose judge runs a model there.
SIZED_FOR_JUDGE_ENV = "RLAIF_POD_SIZED_FOR_JUDGE"


def judge_from_env(value: str | None) -> str | None:
    """$RLAIF_LABEL_JUDGE as the DAGs read it: a pod judge, or None (unset: a judge that runs a model). A misspelt one
    would size label's pod silently wrong (a GPU for a judge that needs none), so it is an import error."""
    if not value or not value.strip():
        return None
    if value.strip() not in POD_JUDGES:
        raise ValueError(f"RLAIF_LABEL_JUDGE={value!r} is not one of {', '.join(POD_JUDGES)}: fix it or unset it")
    return value.strip()


def flag_from_env(name: str, value: str | None) -> bool:
    """A yes/no environment variable of the DAGs (unset: no); a value that is neither is an import error, not a no."""
    text = (value or "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={value!r} is not a yes/no value (1/0, true/false, yes/no, on/off)")


@dataclass(frozen=True)
class SecretRef:
    """One environment variable filled from a key of a Kubernetes secret."""

    env: str
    secret: str
    key: str
    optional: bool


@dataclass(frozen=True)
class PodPlan:
    stage: str
    image: str
    cpu: int
    memory_gib: int
    gpus: int
    gpu_resource: str
    node_selector: dict[str, str]
    tolerations: tuple[Toleration, ...]
    shm_gib: int
    run_as_user: int
    env: dict[str, str]
    secret_env: tuple[SecretRef, ...]
    service_account: str
    namespace: str
    retries: int

    @property
    def pod_name(self) -> str:
        return f"rlaif-{self.stage.replace('_', '-')}"

    def resources(self) -> dict:
        """Kubernetes ResourceRequirements: CPU and memory requested, memory and GPUs limited."""
        limits = {"memory": f"{self.memory_gib}Gi", **({self.gpu_resource: str(self.gpus)} if self.gpus else {})}
        return {"requests": {"cpu": str(self.cpu), "memory": f"{self.memory_gib}Gi"}, "limits": limits}

    def env_list(self) -> list[dict]:
        """Kubernetes EnvVar list: plain values first, then secret references."""
        env = [{"name": name, "value": value} for name, value in sorted(self.env.items())]
        for ref in self.secret_env:
            key_ref = {"name": ref.secret, "key": ref.key, "optional": ref.optional}
            env.append({"name": ref.env, "valueFrom": {"secretKeyRef": key_ref}})
        return env

    def toleration_list(self) -> list[dict]:
        return [{k: v for k, v in vars(t).items() if v is not None} for t in self.tolerations]

    def shm_volume(self) -> dict:
        return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": f"{self.shm_gib}Gi"}}

    def security_context(self) -> dict:
        return {"runAsUser": self.run_as_user, "runAsNonRoot": True}

    def pod_spec(self, container_name: str, command: list[str] | None) -> dict:
        """A plain Kubernetes PodSpec running `command` in the plan's container (None: the image's entrypoint)."""
        container = {"name": container_name, "image": self.image, **({"command": command} if command else {}),
                     "env": self.env_list(), "resources": self.resources(),
                     "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]}
        spec = {"containers": [container], "nodeSelector": dict(self.node_selector),
                "tolerations": self.toleration_list(), "securityContext": self.security_context(),
                "volumes": [self.shm_volume()]}
        if self.service_account:
            spec["serviceAccountName"] = self.service_account
        return spec


def secret_refs(cluster: ClusterSpec) -> tuple[SecretRef, ...]:
    return tuple(SecretRef(env, secret.name, key, secret.optional)
                 for secret in cluster.secrets for env, key in sorted(secret.env.items()))


def service_pod_plan(name: str, cpus: float, memory_gib: int, gpus: float, cluster: ClusterSpec) -> PodPlan:
    """The pod of one replica of a model service (`rlaif serve`): the stages' images, selectors, secrets and
    security context, sized by the config's serve section (a fractional GPU is rounded up: Kubernetes counts
    whole GPUs and CPUs: an HPA's CPU target is a share of the request, and torch uses every core it sees)."""
    whole_gpus = -int(-gpus // 1) if cluster.use_gpus else 0
    return PodPlan(
        stage=name, image=cluster.gpu_image if whole_gpus else cluster.image, cpu=max(1, -int(-cpus // 1)),
        memory_gib=memory_gib, gpus=whole_gpus, gpu_resource=cluster.gpu_resource,
        node_selector={**cluster.node_selector, **(cluster.gpu_node_selector if whole_gpus else {})},
        tolerations=cluster.gpu_tolerations if whole_gpus else (), shm_gib=min(cluster.shm_gib, memory_gib),
        run_as_user=cluster.run_as_user, env=dict(cluster.env), secret_env=secret_refs(cluster),
        service_account=cluster.service_account, namespace=cluster.namespace, retries=cluster.retries)


def stage_gpus(stage: Stage, cluster: ClusterSpec, judge: str | None = None) -> int:
    """GPUs for a stage's pod. cluster.yaml's `stages.<name>.gpus` wins; a stage whose only model is its judge gets
    none when that judge runs no model in the pod (rules, reference, an HTTP endpoint)."""
    if not cluster.use_gpus:
        return 0
    override = cluster.stages.get(stage.name)
    if override and override.gpus is not None:
        return override.gpus
    if stage.resources.gpus == 0 or (stage.resources.gpu_for_judge_only and judge in JUDGES_WITHOUT_MODEL):
        return 0
    # 0 is a choice (CPU pods: launch then runs the config's nproc ranks over gloo), not "unset"
    return cluster.gpus_per_node if cluster.gpus_per_node is not None else stage.resources.gpus


def pod_plan(stage: Stage, cluster: ClusterSpec, judge: str | None = None) -> PodPlan:
    """The pod of `stage` on `cluster`; `judge` is the config's label judge when the config is known when the pipeline
    is compiled (None: assume a judge that runs a model)."""
    override = cluster.stages.get(stage.name)
    gpus = stage_gpus(stage, cluster, judge)
    # None where the stage has its GPUs, or would have none whatever the judge (a CPU cluster, an explicit 0).
    sized_for = {SIZED_FOR_JUDGE_ENV: judge} if gpus == 0 and stage_gpus(stage, cluster) else {}
    memory_gib = (override and override.memory_gib) or stage.resources.memory_gib
    return PodPlan(
        stage=stage.name,
        image=cluster.gpu_image if gpus else cluster.image,
        cpu=(override and override.cpu) or stage.resources.cpu,
        memory_gib=memory_gib,
        gpus=gpus,
        gpu_resource=cluster.gpu_resource,
        node_selector={**cluster.node_selector, **(cluster.gpu_node_selector if gpus else {})},
        tolerations=cluster.gpu_tolerations if gpus else (),
        shm_gib=min(cluster.shm_gib, memory_gib),  # memory-backed: it counts against the pod's memory limit
        run_as_user=cluster.run_as_user,
        # RLAIF_CLUSTER_JSON: a stage with nodes > 1 builds its TrainJob from the same settings.
        env={"RLAIF_CLUSTER_JSON": cluster.to_json(), **sized_for, **cluster.env},
        secret_env=secret_refs(cluster),
        service_account=cluster.service_account,
        namespace=cluster.namespace,
        retries=cluster.retries,
    )

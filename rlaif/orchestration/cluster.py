"""Cluster settings shared by the KFP pipeline, the Airflow DAG and multi-node jobs: images, GPU scheduling,
secrets, retries. Standard library only (Airflow imports it); read from YAML when a file is given.

Nothing secret lives here: only the *names* of Kubernetes secrets, whose keys become environment variables."""
from __future__ import annotations

import json
import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields

from rlaif.errors import looks_secret, one_line
from rlaif.graph import STAGE_BY_NAME

K8S_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # DNS-1123 label (63 at most): namespaces
K8S_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # 253: secrets, accounts
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")  # what every Kubernetes version takes (newer ones take more)
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
QUALIFIED_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # a label key's name part, a label value
# A container image reference as the distribution spec writes it: [registry[:port]/]path[:tag][@algorithm:digest].
_IMAGE_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REGISTRY = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?/)?"
IMAGE_REF = re.compile(rf"{_REGISTRY}{_IMAGE_PART}(?:/{_IMAGE_PART})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
                       r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")


def _check_field_types(settings, where: str = "") -> None:
    """Values Kubernetes takes as strings must be strings here (YAML reads `true` and `1` as others, which the
    manifests would carry unquoted and the API refuse); whole numbers whole, switches true or false."""
    for item in fields(settings):
        value, name = getattr(settings, item.name), where + item.name
        optional = item.type.endswith(" | None") and value is None
        kind = item.type.removesuffix(" | None")
        if optional or kind not in _TYPE_CHECKS:
            continue
        if not _TYPE_CHECKS[kind](value):
            raise ValueError(_TYPE_ERRORS[kind].format(name=name, value=value))


_TYPE_CHECKS = {
    "str": lambda value: isinstance(value, str),
    "bool": lambda value: isinstance(value, bool),
    "int": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "dict[str, str]": lambda value: isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()),
}
_TYPE_ERRORS = {
    "str": "{name} must be text, not {value!r}: put it in quotes",
    "bool": "{name} must be true or false, not {value!r}",
    "int": "{name} must be a whole number, not {value!r}",
    "dict[str, str]": "{name} must map text to text, got {value!r}: put values such as true or 1 in quotes",
}


def subdomain(text: str) -> bool:
    """A DNS-1123 subdomain (secret and service-account names, a qualified name's prefix): 253 characters at most."""
    return len(text) <= 253 and bool(K8S_SUBDOMAIN.fullmatch(text))


def qualified_name(text: str) -> bool:
    """A Kubernetes qualified name (label keys, taint keys, extended resources): [prefix/]name, the prefix a DNS
    subdomain of at most 253 characters, the name at most 63 of letters, digits, '-', '_', '.'."""
    prefix, _, name = text.rpartition("/")
    if "/" in text and not subdomain(prefix):
        return False
    return len(name) <= 63 and bool(QUALIFIED_PART.fullmatch(name))


def label_value_valid(text: str) -> bool:
    return text == "" or (len(text) <= 63 and bool(QUALIFIED_PART.fullmatch(text)))


@dataclass(frozen=True)
class SecretEnv:
    """A Kubernetes secret whose keys are exposed to every stage as environment variables."""

    name: str
    """Secret name in the namespace where the pipeline runs."""
    env: dict[str, str]
    """Environment variable -> key in the secret."""
    optional: bool = False
    """Pods still start when the secret is absent (e.g. a judge key that only some configs need)."""

    def __post_init__(self):
        _check_field_types(self, "secrets: ")
        if not subdomain(self.name):
            raise ValueError(f"secret {self.name!r} is not a Kubernetes name (lowercase letters, digits, '-' and '.')")
        for variable, key in self.env.items():
            if not ENV_NAME.fullmatch(variable):
                raise ValueError(f"secret {self.name}: {variable!r} is not an environment variable name")
            if not (len(key) <= 253 and SECRET_KEY.fullmatch(key)):
                raise ValueError(f"secret {self.name}: {key!r} (for {variable}) is not a secret key (letters, digits, "
                                 "'-', '_' and '.')")


TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class Toleration:
    key: str = ""
    operator: str | None = None
    """Exists or Equal; left out: Equal where a value is given (Kubernetes' default), else Exists."""
    value: str | None = None
    effect: str | None = "NoSchedule"

    def __post_init__(self):
        # Kubernetes refuses these only when the pod is created: in the first pod of a run, not at compile time.
        _check_field_types(self, "gpu_tolerations: ")
        if self.operator is None:
            object.__setattr__(self, "operator", "Equal" if self.value else "Exists")
        if self.key and not qualified_name(self.key):
            raise ValueError(f"gpu_tolerations: key {self.key!r} is not a taint key (such as nvidia.com/gpu)")
        if not self.key and self.operator != "Exists":
            raise ValueError("gpu_tolerations: an entry without a key tolerates every taint and needs operator Exists")
        if self.operator == "Exists" and self.value:
            raise ValueError(f"gpu_tolerations: {self.key!r} has operator Exists and value {self.value!r}: a value "
                             "needs operator Equal")
        if self.value and not label_value_valid(self.value):
            raise ValueError(f"gpu_tolerations: value {self.value!r} of {self.key!r} is not a taint value")
        if self.operator not in TOLERATION_OPERATORS:
            raise ValueError(f"gpu_tolerations: operator {self.operator!r} of {self.key!r} must be Exists or Equal")
        if self.effect not in (None, "", *TOLERATION_EFFECTS):
            raise ValueError(f"gpu_tolerations: effect {self.effect!r} of {self.key!r} must be one of "
                             f"{', '.join(TOLERATION_EFFECTS)}, or left out for all effects")


@dataclass(frozen=True)
class StageResources:
    """Per-stage overrides of graph.py's pod sizes; None keeps the default."""

    cpu: int | None = None
    memory_gib: int | None = None
    gpus: int | None = None

    def __post_init__(self):
        _check_field_types(self)
        for name in ("cpu", "memory_gib", "gpus"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, not {value!r}")
        if self.cpu == 0 or self.memory_gib == 0:
            raise ValueError("cpu and memory_gib must be at least 1")


@dataclass(frozen=True)
class ClusterSpec:
    image: str = "ghcr.io/rlaif/rlaif:0.1.0"
    """CPU image (images/cpu/Dockerfile) for stages that get no GPU."""
    gpu_image: str = "ghcr.io/rlaif/rlaif:0.1.0-cuda"
    """CUDA image (images/cuda/Dockerfile) for stages with GPUs."""
    use_gpus: bool = True
    """False on CPU-only clusters: every stage gets the CPU image and no GPU limit."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name of the GPUs."""
    gpus_per_node: int | None = None
    """GPUs per pod for the GPU stages; None: graph.py's per-stage default; 0: they run on CPU, as with use_gpus
    false (the CPU image, their config's nproc ranks over gloo)."""
    gpu_node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels that pick the GPU type, e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}."""
    gpu_tolerations: tuple[Toleration, ...] = (Toleration(key="nvidia.com/gpu"),)
    """Tolerations for GPU node taints."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels every stage's pod requires."""
    secrets: tuple[SecretEnv, ...] = (
        SecretEnv(name="rlaif-storage", env={"AWS_ACCESS_KEY_ID": "access_key", "AWS_SECRET_ACCESS_KEY": "secret_key"}),
        SecretEnv(name="rlaif-judge", env={"RLAIF_JUDGE_API_KEY": "api_key"}, optional=True),
        SecretEnv(name="rlaif-hf", env={"HF_TOKEN": "token"}, optional=True),
        SecretEnv(name="rlaif-tracking", env={"WANDB_API_KEY": "wandb_api_key", "MLFLOW_TRACKING_TOKEN": "mlflow_token",
                                              "MLFLOW_TRACKING_USERNAME": "mlflow_username",
                                              "MLFLOW_TRACKING_PASSWORD": "mlflow_password"}, optional=True),
    )
    """Secrets mapped to environment variables in every stage (storage credentials, judge API key, a Hugging Face
    token for gated hub models, tracker credentials)."""
    env: dict[str, str] = field(default_factory=dict)
    """Plain (non-secret) environment variables for every stage, e.g. AWS_ENDPOINT_URL of the cluster's MinIO."""
    shm_gib: int = 8
    """Size of the memory-backed /dev/shm (PyTorch DataLoader workers and NCCL need more than the 64 MiB default)."""
    retries: int = 2
    """Retries of a failed stage. A retry resumes: finished stages are cache hits, training resumes from checkpoints."""
    namespace: str = ""
    """Namespace for Airflow pods and multi-node jobs; empty: the namespace the pipeline pod runs in (or `default`)."""
    service_account: str = ""
    """Service account for the pods; a multi-node stage's account needs RBAC to create and watch TrainJobs."""
    multinode_api: str = "trainjob"
    """`trainjob` (Kubeflow Trainer v2) or `pytorchjob` (the older training operator) for stages with nodes > 1."""
    trainjob_runtime: str = "torch-distributed"
    """ClusterTrainingRuntime a TrainJob refers to."""
    multinode_start_timeout_s: int = 3600
    """How long a multi-node job's pods may wait for nodes (unschedulable: no node has the GPUs, a node pool scaling
    up) before the step fails with the scheduler's reason; 0 waits for good. A pod whose container cannot start (an
    image that does not pull, a missing secret key) fails the step after 5 minutes whatever this says."""
    run_as_user: int = 1000
    """Non-root user of the images (pods run with runAsNonRoot, so 0 would never start)."""
    stages: dict[str, StageResources] = field(default_factory=dict)
    """Per-stage pod sizes, e.g. {"ppo": {"cpu": 16, "memory_gib": 64, "gpus": 8}, "label": {"gpus": 0}}."""

    def __post_init__(self):
        _check_types(self)
        if self.multinode_api not in ("trainjob", "pytorchjob"):
            raise ValueError(f"multinode_api must be 'trainjob' or 'pytorchjob', not {self.multinode_api!r}")
        unknown = sorted(set(self.stages) - set(STAGE_BY_NAME))
        if unknown:
            raise ValueError(f"stages: unknown stage(s) {', '.join(unknown)}; stages are {', '.join(STAGE_BY_NAME)}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _check_types(spec: ClusterSpec) -> None:
    """The field types, then the names Kubernetes would refuse only when it creates the first pod of a run; secrets
    stay out of plain `env`."""
    _check_field_types(spec)
    if not spec.image or not spec.gpu_image:
        raise ValueError("image and gpu_image must name container images")
    for name, image in (("image", spec.image), ("gpu_image", spec.gpu_image)):
        if not IMAGE_REF.fullmatch(image):
            raise ValueError(f"{name} {image!r} is not a container image reference: write it as "
                             "registry/name:tag, e.g. ghcr.io/rlaif/rlaif:0.1.0 (no spaces, lowercase name)")
    for name, value, low, high in (("gpus_per_node", spec.gpus_per_node, 0, 64), ("shm_gib", spec.shm_gib, 1, 4096),
                                   ("retries", spec.retries, 0, 100), ("run_as_user", spec.run_as_user, 1, 2**31 - 1),
                                   ("multinode_start_timeout_s", spec.multinode_start_timeout_s, 0, 7 * 86400)):
        if value is not None and not low <= value <= high:
            raise ValueError(f"{name} must be between {low} and {high}, not {value}")
    if spec.namespace and not (len(spec.namespace) <= 63 and K8S_LABEL.fullmatch(spec.namespace)):
        raise ValueError(f"namespace {spec.namespace!r} is not a Kubernetes namespace name (lowercase letters, "
                         "digits and '-', 63 at most)")
    for what, name in (("service_account", spec.service_account), ("trainjob_runtime", spec.trainjob_runtime)):
        if name and not subdomain(name):
            raise ValueError(f"{what} {name!r} is not a Kubernetes name (lowercase letters, digits, '-' and '.')")
    _check_scheduling_names(spec)
    for name in spec.env:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"env: {name!r} is not an environment variable name")
        if looks_secret(name):
            raise ValueError(f"env: {name} looks like a credential, which `env` would write into the pipeline in "
                             "plain text: put it in a Kubernetes secret and map it under `secrets`")
    _check_variables_unique(spec.secrets, spec.env)


def _check_scheduling_names(spec: ClusterSpec) -> None:
    for what, selector in (("node_selector", spec.node_selector), ("gpu_node_selector", spec.gpu_node_selector)):
        for key, value in selector.items():
            if not qualified_name(key):
                raise ValueError(f"{what}: {key!r} is not a node label key ([prefix/]name, e.g. "
                                 "nvidia.com/gpu.product)")
            if not label_value_valid(value):
                raise ValueError(f"{what}: {value!r} (for {key}) is not a label value (at most 63 letters, digits, "
                                 "'-', '_', '.', beginning and ending with a letter or digit)")
    if not ("/" in spec.gpu_resource and qualified_name(spec.gpu_resource)):
        raise ValueError(f"gpu_resource {spec.gpu_resource!r} is not an extended resource name (domain/name, e.g. "
                         "nvidia.com/gpu or amd.com/gpu)")


def _check_variables_unique(secrets: tuple[SecretEnv, ...], env: dict[str, str]) -> None:
    """One source per environment variable (a secret, or plain `env`): with two, the pod would get whichever
    Kubernetes applies last. rlaif's own variables are never the user's: a shared RLAIF_LOCK_OWNER let a second
    run take the first's locks, RLAIF_ERROR_FILE hid every error from the pod log, RLAIF_FRESH_START dropped every
    checkpoint."""
    owner: dict[str, str] = {}
    for secret in secrets:
        for variable in secret.env:
            _not_internal(variable, f"secrets: {secret.name} maps")
            if variable in owner:
                raise ValueError(f"secrets: {variable} is mapped by both {owner[variable]} and {secret.name}: keep "
                                 "one of them")
            owner[variable] = secret.name
    for variable in env:
        if variable in owner:
            raise ValueError(f"env: {variable} is also mapped by secret {owner[variable]}: keep one of them")
        _not_internal(variable, "env:")


# Set by rlaif's launchers for the processes they start (and the test suite's fault switch); the documented switches
# (RLAIF_DECODER, RLAIF_PACKING, RLAIF_CPU_KERNELS, RLAIF_CACHE, RLAIF_BIN, ...) stay the user's.
INTERNAL_VARIABLES = ("RLAIF_CLUSTER_JSON", "RLAIF_POD_SIZED_FOR_JUDGE", "RLAIF_LOCK_OWNER", "RLAIF_CACHE_CHECKED",
                      "RLAIF_LAUNCHED_CONFIG", "RLAIF_ERROR_FILE", "RLAIF_FRESH_START", "RLAIF_FAULT",
                      "RLAIF_MACHINE_TMPDIR")


def _not_internal(variable: str, where: str) -> None:
    if variable in INTERNAL_VARIABLES:
        raise ValueError(f"{where} {variable}, which rlaif sets itself for the processes it starts: remove it")


def from_dict(raw: dict) -> ClusterSpec:
    """A ClusterSpec from plain data, refusing unknown keys (a typo must not silently fall back to a default)."""
    raw = dict(raw)
    _refuse_unknown(raw, ClusterSpec, "cluster setting")
    if "secrets" in raw:
        raw["secrets"] = tuple(SecretEnv(**_entry(s, SecretEnv, "secrets")) for s in _listed(raw["secrets"], "secrets"))
    if "gpu_tolerations" in raw:
        raw["gpu_tolerations"] = tuple(Toleration(**_entry(t, Toleration, "gpu_tolerations"))
                                       for t in _listed(raw["gpu_tolerations"], "gpu_tolerations"))
    if "stages" in raw:
        stages = raw["stages"] or {}
        if not isinstance(stages, dict):
            raise ValueError(f"stages must map stage names to pod sizes, not {stages!r}")
        raw["stages"] = {name: _stage_sizes(name, sizes) for name, sizes in stages.items()}
    return ClusterSpec(**raw)


def _stage_sizes(stage: str, sizes) -> StageResources:
    try:
        return StageResources(**_entry(sizes, StageResources, f"stages.{stage}"))
    except ValueError as exc:  # the sizes' own checks do not know which stage they are
        message = str(exc)
        raise ValueError(message if message.startswith("stages.") else f"stages.{stage}: {message}") from None


def _refuse_unknown(raw: dict, kind, what: str) -> None:
    known = {f.name for f in fields(kind)}
    unknown = sorted(map(str, set(raw) - known))
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _listed(value, what: str) -> list:
    if value is None:  # `secrets:` with nothing after it: none
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list of entries, not {value!r}")
    return list(value)


def _entry(value, kind, what: str) -> dict:
    """One nested entry (a secret, a toleration, a stage's sizes) as keyword arguments, its keys checked."""
    known = [f.name for f in fields(kind)]
    if not isinstance(value, dict):
        raise ValueError(f"{what}: give a mapping with keys among {', '.join(known)}, got {value!r}")
    _refuse_unknown(value, kind, f"{what} key")
    required = [f.name for f in fields(kind) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in value]
    if missing:
        raise ValueError(f"{what}: {value!r} lacks {', '.join(missing)}")
    return value


def load(path: str | None = None) -> ClusterSpec:
    """From a YAML or JSON file, else from $RLAIF_CLUSTER_JSON (set on pods by the pipeline), else the defaults."""
    from rlaif.errors import UserError

    source = path or ("$RLAIF_CLUSTER_JSON" if os.environ.get("RLAIF_CLUSTER_JSON") else None)
    if source is None:
        return ClusterSpec()
    try:
        if path:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        else:
            text = os.environ["RLAIF_CLUSTER_JSON"]
        if path and path.endswith((".yaml", ".yml")):
            import yaml

            from rlaif.io.strict_yaml import UniqueKeyLoader

            raw = yaml.load(text, Loader=UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader subclass
        else:
            raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("expected a mapping of cluster settings")
        return from_dict(raw)
    except OSError as exc:
        raise UserError(f"cluster settings {source}: cannot read it ({exc.strerror}): give a YAML file such as "
                        "configs/cluster.yaml") from None
    except Exception as exc:  # ValueError, TypeError (a wrong key), JSON and YAML syntax: all the file's fault
        reason = one_line(exc)
        raise UserError(f"cluster settings {source}: {reason}: see configs/cluster.yaml for every key") from None

"""Kubernetes manifests for a model service, rendered from the config's serve section and cluster.yaml (the same
images, selectors, tolerations, secrets and security context as the stages' pods, from orchestration/pod.py):

- `rayservice`: a KubeRay RayService: a Ray cluster (head + a worker group of replica-sized pods, autoscaled by
  KubeRay when serve.autoscale) whose serveConfigV2 deploys `rlaif.serving.ray_app:build` with this config.
- `deployment`: no Ray: a ConfigMap (the config), a Deployment of `rlaif serve --no-ray` pods (one replica each), a
  Service in front of them, and (serve.autoscale) a HorizontalPodAutoscaler on CPU utilisation.
"""
from __future__ import annotations

import sys
from dataclasses import replace

import yaml

from rlaif.config import PipelineConfig, dump_config
from rlaif.errors import UserError
from rlaif.orchestration.cluster import ClusterSpec
from rlaif.orchestration.pod import service_pod_plan

RAY_VERSION = "2.60.0"
CONFIG_DIR = "/etc/rlaif"
HEAD_MEMORY_GIB = 4  # the Ray head: GCS, dashboard and Serve's controller and proxy
HPA_CPU_TARGET = 70  # percent: a CPU replica is saturated by one request at a time, so scale before it queues


# Ports KubeRay's Ray pods already use (the head's; metrics and the dashboard agent on every pod, where Serve's
# proxies listen too).
RAY_PORTS = {6379: "the GCS", 8265: "the dashboard", 10001: "the Ray client server", 8080: "the metrics export",
             52365: "the dashboard agent"}


def _plan(cfg: PipelineConfig, cluster: ClusterSpec, ray: bool):
    s = cfg.serve
    if s.gpus_per_replica and not cluster.use_gpus:  # a replica would ask Ray for a GPU no node has: never placed
        raise UserError(f"serve.gpus_per_replica={s.gpus_per_replica:g} on a cluster without GPUs (use_gpus false in "
                        "the cluster settings): set serve.gpus_per_replica=0, or give a GPU cluster's settings")
    if s.engine == "vllm" and not s.gpus_per_replica:  # its pods would be CPU pods of the CPU image
        raise UserError("serve.engine=vllm needs a GPU per replica: set serve.gpus_per_replica=1 (or a fraction), or "
                        "serve.engine=transformers (auto picks vllm where a replica has a GPU)")
    if fractions := [f"serve.{name}={value:g}" for name, value in (("cpus_per_replica", s.cpus_per_replica),
                                                                  ("gpus_per_replica", s.gpus_per_replica))
                     if value % 1]:
        print(f"note: {' and '.join(fractions)}: each replica's pod requests whole CPUs and GPUs (rounded up)"
              + ("; Ray Serve's replicas take the fractions of them" if ray else ""), file=sys.stderr)
    return service_pod_plan(s.service_name, s.cpus_per_replica, s.memory_gib, s.gpus_per_replica, cluster)


def _serve_config(cfg: PipelineConfig) -> str:
    """serveConfigV2: one application at `/`, built by rlaif from the embedded config (replicas, autoscaling and
    resources come from its serve section, as `rlaif serve` applies them locally)."""
    app = {"name": cfg.serve.service_name, "route_prefix": "/", "import_path": "rlaif.serving.ray_app:build",
           "args": {"config": dump_config(cfg)}}
    return yaml.safe_dump({"http_options": {"host": "0.0.0.0", "port": cfg.serve.port}, "applications": [app]},
                          sort_keys=False)


def rayservice(cfg: PipelineConfig, cluster: ClusterSpec) -> list[dict]:
    s, plan = cfg.serve, _plan(cfg, cluster, ray=True)
    if s.port in RAY_PORTS:  # two container ports of one number: the RayService is refused, or Serve never binds
        raise UserError(f"serve.port={s.port} is {RAY_PORTS[s.port]}'s port in the Ray pods: choose another (8000 is "
                        "Ray Serve's)")
    # The head holds no replica: no GPU, one CPU (KubeRay supplies `ray start` to both groups)
    head = replace(plan, image=cluster.image, cpu=1, memory_gib=HEAD_MEMORY_GIB, gpus=0,
                   shm_gib=min(cluster.shm_gib, HEAD_MEMORY_GIB), node_selector=dict(cluster.node_selector),
                   tolerations=()).pod_spec("ray-head", None)
    head["containers"][0]["ports"] = [{"containerPort": 6379, "name": "gcs"},
                                      {"containerPort": 8265, "name": "dashboard"},
                                      {"containerPort": s.port, "name": "serve"}]
    worker = plan.pod_spec("ray-worker", None)
    workers = {"groupName": "replicas", "replicas": s.replicas,
               "minReplicas": s.min_replicas if s.autoscale else s.replicas,
               "maxReplicas": s.max_replicas if s.autoscale else s.replicas,
               "rayStartParams": {}, "template": {"spec": worker}}
    spec = {"serveConfigV2": _serve_config(cfg),
            "rayClusterConfig": {"rayVersion": RAY_VERSION, "enableInTreeAutoscaling": s.autoscale,
                                 "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                                                   "template": {"spec": head}},
                                 "workerGroupSpecs": [workers]}}
    return [{"apiVersion": "ray.io/v1", "kind": "RayService",
             "metadata": {"name": s.service_name, "namespace": cluster.namespace}, "spec": spec}]


def deployment(cfg: PipelineConfig, cluster: ClusterSpec) -> list[dict]:
    s, plan = cfg.serve, _plan(cfg, cluster, ray=False)
    if s.autoscale and s.min_replicas == 0:  # rather than a manifest that silently keeps one replica up
        raise UserError("serve.min_replicas=0 scales to zero on Ray Serve only; a HorizontalPodAutoscaler keeps at "
                        "least 1 (HPAScaleToZero is an alpha feature gate): set serve.min_replicas=1, or use "
                        "--manifest rayservice")
    meta = {"name": s.service_name, "namespace": cluster.namespace}
    labels = {"app.kubernetes.io/name": s.service_name, "app.kubernetes.io/part-of": "rlaif"}
    pod = plan.pod_spec("server", ["rlaif", "serve", "--no-ray", "--config", f"{CONFIG_DIR}/config.yaml",
                                   "--set", "serve.host=0.0.0.0", "--set", "serve.route_prefix=/"])  # as Ray's
    container = pod["containers"][0]
    container["ports"] = [{"containerPort": s.port, "name": "http"}]
    container["volumeMounts"].append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10}
    container.update(readinessProbe={**probe, "initialDelaySeconds": 5},
                     startupProbe={**probe, "failureThreshold": 60})  # loading a model takes a while
    pod["volumes"].append({"name": "config", "configMap": {"name": meta["name"]}})
    docs = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"config.yaml": dump_config(cfg)}},
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": labels},
             "spec": {"replicas": s.replicas, "selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels}, "spec": pod}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {**meta, "labels": labels},
             "spec": {"selector": labels, "ports": [{"name": "http", "port": s.port, "targetPort": "http"}]}}]
    if s.autoscale:
        metric = {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                                              "averageUtilization": HPA_CPU_TARGET}}}
        docs.append({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
                     "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"]},
                              "minReplicas": s.min_replicas, "maxReplicas": s.max_replicas,
                              "metrics": [metric]}})
    return docs


KINDS = {"rayservice": rayservice, "deployment": deployment}


def render(cfg: PipelineConfig, cluster: ClusterSpec, kind: str) -> str:
    check_model_reachable(cfg)
    return yaml.safe_dump_all(KINDS[kind](cfg, cluster), sort_keys=False)


def check_model_reachable(cfg: PipelineConfig) -> None:
    """The served model is one the service's pods can load: a Hub id, an s3:// URL, a built-in model, or an absolute
    path their image holds. A relative path (it resolves in the image's working directory) or a path that is on this
    machine (a run's output here, most often) would fail only once deployed."""
    from pathlib import Path

    from rlaif.io import hub

    setting, spec = ("policy.model", cfg.policy.model) if cfg.serve.model == "policy" else \
        ("label.hf.model", cfg.label.hf.model)
    if spec.startswith(("s3://", "builtin:")) or hub.parse(spec):
        return
    path = spec.removeprefix("file://")
    if not Path(path).is_absolute() or Path(path).exists():
        raise UserError(f"{setting} {spec} is a path on this machine, which the service's pods cannot read: upload "
                        "the model (e.g. a run's output under an s3:// storage root) and give its s3:// URL or a Hub "
                        "id, or an absolute path inside the image")

"""Settings of the model services: how a stage reaches one (`ServiceEndpoint`) and how `rlaif serve` deploys one
(`ServeConfig`)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlaif.config.base import Strict, described, service_url


class ServiceEndpoint(Strict):
    """An OpenAI-compatible completions service and how to call it: timeouts, retries, requests in flight."""

    base_url: str = ""
    """API root, e.g. `http://rlaif-policy:8000/v1` (what `rlaif serve` prints); empty: the model runs in-process."""
    api_key_env: str = ""
    """Name of the environment variable holding a bearer token for the service (never the key itself); empty: none."""
    concurrency: int = Field(16, ge=1, le=4096)
    """Requests in flight at once (spread over the service's replicas by its load balancer)."""
    timeout_s: float = Field(120.0, gt=0, le=86400)
    """Seconds before a request is abandoned and retried."""
    max_retries: int = Field(5, ge=0, le=100)
    """Retries of a request after a timeout, a connection error, 429 or 5xx (exponential backoff, Retry-After): a
    replica that dies mid-request costs a retry, not a pair."""
    backoff_s: float = Field(1.0, ge=0, le=600)
    """First retry delay; doubles per retry, with jitter."""

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        return service_url(v, "http://rlaif-policy:8000/v1")


class ServeConfig(Strict):
    """`rlaif serve`: one model (the policy or the label judge) as an OpenAI-compatible completions service on Ray
    Serve, and the Kubernetes manifests for the same service (`rlaif serve --manifest`). Not part of any cache key."""

    model: Literal["policy", "judge"] = "policy"
    """Which model of this config to serve: `policy` (policy.model, for generate.backend endpoint) or `judge`
    (label.hf.model, for label.hf.endpoint)."""
    engine: Literal["auto", "transformers", "vllm"] = "auto"
    """Inside each replica: `vllm` (a GPU and the vllm extra), `transformers` (any machine), `auto`: vllm where a
    GPU and vLLM are present, else transformers. A stage refuses a service whose engine differs from its own
    (generate.backend endpoint expects generate.endpoint_engine)."""
    replicas: int = Field(1, ge=1, le=1024)
    """Replicas at start (and always, when autoscaling is off)."""
    autoscale: bool = False
    """Scale between min_replicas and max_replicas on requests in flight per replica (Ray Serve autoscaling; the HPA
    on CPU utilisation for the plain Deployment)."""
    min_replicas: int = Field(1, ge=0, le=1024)
    """Fewest replicas when autoscaling (0 lets an idle service scale to zero on Ray Serve; `--manifest deployment`,
    whose HorizontalPodAutoscaler keeps at least one, refuses 0)."""
    max_replicas: int = Field(4, ge=1, le=1024)
    """Most replicas when autoscaling."""
    target_ongoing_requests: float = Field(4.0, gt=0, le=10_000)
    """Autoscaling target: requests in flight per replica."""
    max_ongoing_requests: int = Field(16, ge=1, le=10_000)
    """Requests one replica accepts at once; more wait in the proxy's queue."""
    cpus_per_replica: float = Field(1.0, gt=0, le=1024)
    """CPUs reserved per replica (Ray actor and Kubernetes request)."""
    gpus_per_replica: float = Field(0.0, ge=0, le=64)
    """GPUs per replica (fractions share a GPU on Ray Serve; the plain Deployment rounds up)."""
    memory_gib: int = Field(8, ge=1, le=4096)
    """Memory per replica (Kubernetes request and limit)."""
    max_request_cache_gib: float = Field(4.0, gt=0, le=4096)
    """Most attention cache (GiB) one request may need: a request is one batch, its prompts padded to the longest
    plus max_tokens; a bigger one is refused (HTTP 400) instead of taking the replica out of memory. The transformers
    engine only (vLLM schedules its own cache)."""
    host: str = Field("127.0.0.1", min_length=1, max_length=253)
    """Address the HTTP proxy binds locally (0.0.0.0 to accept other machines)."""
    port: int = Field(8000, ge=1, le=65535)
    """HTTP port of the service."""
    route_prefix: str = Field("/", pattern=described(r"^/([A-Za-z0-9_-]+)?$", "/ or one path segment, e.g. /policy "
                                                                           "(letters, digits, '-', '_')"))
    """Path of this service (`/`, or `/policy` to host several services on one Ray cluster and port; `--no-ray`
    serves under it too); the API root is then http://HOST:PORT<route_prefix>/v1. The Kubernetes manifests serve at
    `/` (each service has its own name)."""
    name: str = Field("", max_length=40, pattern=described(r"^([a-z]([-a-z0-9]*[a-z0-9])?)?$", "a Kubernetes "
                      "Service name: lowercase letters, digits and '-', starting with a letter, ending with a "
                      "letter or digit"))
    """Kubernetes name of the service; empty: rlaif-<model>."""

    @model_validator(mode="after")
    def _bounds(self):
        if self.autoscale and not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"with autoscale, min_replicas ({self.min_replicas}) <= replicas ({self.replicas}) <= "
                             f"max_replicas ({self.max_replicas}) must hold")
        return self

    @property
    def service_name(self) -> str:
        return self.name or f"rlaif-{self.model}"

    @property
    def base_url(self) -> str:
        """What a stage's endpoint base_url is set to, for a client on this machine."""
        return f"http://{self.host}:{self.port}{self.route_prefix.rstrip('/')}/v1"

"""The model service on Ray Serve: one deployment whose replicas each hold the model (an engine), behind Serve's HTTP
proxy, which spreads requests over replicas and replaces a replica that dies. `build` is the application builder a
KubeRay RayService names in its serveConfigV2 (import_path `rlaif.serving.ray_app:build`); `rlaif serve` runs the same
application on a local Ray instance."""
import signal
import threading
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve
from starlette.requests import Request as StarletteRequest

from rlaif.config import PipelineConfig, dump_config, parse_config
from rlaif.serving import api

app = FastAPI(title="rlaif model service")


@serve.deployment(name="model")
@serve.ingress(app)
class ModelServer:
    def __init__(self, config_yaml: str):
        from rlaif.serving.engine import make_engine

        cfg = parse_config(config_yaml, "the service's config")
        self.name = cfg.serve.service_name
        self.engine = make_engine(cfg, cfg.serve.model)

    @app.get("/healthz")
    async def healthz(self):
        return {"ok": True}

    @app.get("/v1/models")
    async def models(self):
        return JSONResponse(api.models(self.engine, self.name), headers=api.replica_headers())

    @app.post("/v1/completions")
    async def completions(self, request: StarletteRequest):  # a real annotation (no postponed ones in this module):
        # Serve's class-based view cannot resolve a string one, and FastAPI would take `request` for a query parameter
        return await api.completion_response(self.engine, self.name, await request.body())


def deployment_options(cfg: PipelineConfig) -> dict:
    """Replicas (or autoscaling bounds) and each replica's CPUs and GPUs, from the config's serve section."""
    settings = cfg.serve
    scaling = ({"autoscaling_config": {"min_replicas": settings.min_replicas, "max_replicas": settings.max_replicas,
                                       "initial_replicas": settings.replicas,
                                       "target_ongoing_requests": settings.target_ongoing_requests}}
               if settings.autoscale else {"num_replicas": settings.replicas})
    return {**scaling, "max_ongoing_requests": settings.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": settings.cpus_per_replica, "num_gpus": settings.gpus_per_replica}}


def application(cfg: PipelineConfig):
    return ModelServer.options(**deployment_options(cfg)).bind(dump_config(cfg))


def build(args: dict):
    """Application builder for Serve config files (KubeRay's serveConfigV2): args {config: YAML text}."""
    return application(parse_config(args["config"], "serveConfigV2 args.config"))


def start_serve(settings, attempts: int = 5) -> None:
    """Start Serve on the cluster, or join the Serve already there. Two `rlaif serve` (the policy's and the judge's)
    starting at once on a fresh cluster race to create Serve's controller, a named actor that Ray creates without
    get_if_exists: the loser gets ActorAlreadyExistsError (or, when both passed the name check, a dead actor) and, a
    moment later, finds the winner's controller."""
    from ray.exceptions import ActorAlreadyExistsError, RayActorError

    for attempt in range(attempts):
        try:
            serve.start(http_options={"host": settings.host, "port": settings.port})
            return
        except (ActorAlreadyExistsError, RayActorError):
            if attempt == attempts - 1:
                raise
            time.sleep(1.0 + attempt)


def run(cfg: PipelineConfig, address: str | None) -> None:
    """Start Ray (or join the cluster at `address`), deploy the service and block until SIGINT/SIGTERM; then remove
    it (and stop Ray when this process started it)."""
    import ray

    settings = cfg.serve
    ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    start_serve(settings)
    serve.run(application(cfg), name=settings.service_name, route_prefix=settings.route_prefix, blocking=False)
    replicas = (f"{settings.min_replicas}-{settings.max_replicas} replicas (autoscaling)" if settings.autoscale
                else f"{settings.replicas} replica{'s' * (settings.replicas > 1)}")
    print(f"serving the {settings.model} at {settings.base_url} on Ray Serve, {replicas}; Ctrl-C stops it",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if address:  # a shared cluster: remove only this service
        serve.delete(settings.service_name)
    else:
        serve.shutdown()
    ray.shutdown()

"""The model service on Ray Serve: one deployment whose replicas each hold the model (an engine), behind Serve's HTTP
proxy, which spreads requests over replicas and replaces a replica that dies. `build` is the application builder a
KubeRay RayService names in its serveConfigV2 (import_path `rlaif.serving.ray_app:build`); `rlaif serve` runs the same
application on a local Ray instance."""
import contextlib
import logging
import os
import signal
import socket
import threading
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve
from starlette.requests import Request as StarletteRequest

from rlaif.config import PipelineConfig, dump_config, parse_config
from rlaif.errors import UserError, one_line
from rlaif.serving import api
from rlaif.stopping import stop_signals

app = FastAPI(title="rlaif model service")


@serve.deployment(name="model")
@serve.ingress(app)
class ModelServer:
    def __init__(self, config_yaml: str):
        from rlaif.serving.engine import make_engine

        cfg = parse_config(config_yaml, "the service's config")
        self.name = cfg.serve.service_name
        try:
            self.engine = make_engine(cfg, cfg.serve.model)
        except UserError:
            raise
        except Exception as exc:  # one line last in Serve's status, which `rlaif serve` shows (replica_error)
            raise UserError(f"{type(exc).__name__}: {one_line(exc)}") from exc

    @app.get("/healthz")
    async def healthz(self):
        return {"ok": True}

    @app.get("/v1/models")
    async def models(self):
        return JSONResponse(api.models(self.engine, self.name), headers=api.replica_headers())

    @app.post("/v1/completions")
    async def completions(self, request: StarletteRequest):  # a real annotation (no postponed ones in this module):
        # Serve's class-based view cannot resolve a string one, and FastAPI would take `request` for a query parameter
        return await api.completion_response(self.engine, self.name, request)


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
            break
        except (ActorAlreadyExistsError, RayActorError):
            if attempt == attempts - 1:
                raise
            time.sleep(1.0 + attempt)


def check_serves_port(settings) -> None:
    """A Serve already running on a cluster keeps the HTTP host and port it first started with (Ray ignores a later
    start's): a service given others would be announced where nothing listens."""
    try:
        from ray.serve.context import _get_global_client

        running = _get_global_client().http_config
    except (ImportError, AttributeError):  # a Ray whose private client moved: Serve's own warning says it
        return
    for field, value in (("host", running.host), ("port", running.port)):
        if value != getattr(settings, field):
            raise UserError(f"serve.{field}={getattr(settings, field)}, but the Ray Serve already running on this "
                            f"cluster listens on {field} {value} (Serve keeps the HTTP options it started with): set "
                            f"serve.{field}={value} and a serve.route_prefix of this service's own")


class _SilenceServesJoinNotice(logging.Filter):
    """Serve logs that new HTTP options 'will not be applied' on every start after the first, its own included (a
    fresh Ray's serve.run joins the Serve that start_serve began); check_serves_port says what applies."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Connecting to existing Serve app")
                    or message.startswith("The new client HTTP config differs"))


PREFLIGHT_TIMEOUT_S = 10.0
# Ray 2.x retries a GCS address that accepts connections but never answers 20 times, ~40 s each, and its per-try
# timeout (RAY_py_gcs_connect_timeout_s) is fixed once ray is imported; one try (this setting, read by each
# ray.init) bounds joining such a listener to ~40 s. A user's own setting of it wins.
GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"
ADDRESS_FORMS = ("host:port (the head's GCS port, e.g. 10.0.0.5:6379), ray://host:port (Ray Client, e.g. "
                 "ray://10.0.0.5:10001) or auto (the cluster `ray start` began on this machine)")


def target_address(address: str | None) -> tuple[str | None, str]:
    """The cluster ray.init will join and where that address came from: as Ray does, RAY_ADDRESS stands in for a
    missing --address or for auto. None: start Ray here."""
    from_env = os.environ.get("RAY_ADDRESS")
    if from_env and address in (None, "auto"):
        return from_env, "RAY_ADDRESS"
    return address, "--address"


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of host:port, [ipv6]:port or ray://either; None for anything else (Ray's own parser takes ports
    like 'x' or 99999 and hosts with spaces, and fails later or hangs)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an IPv6 host needs brackets, or its port is ambiguous
        return None
    if not sep or not host or any(c.isspace() for c in host) or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def preflight(address: str, source: str) -> None:
    """Refuse, within PREFLIGHT_TIMEOUT_S, a cluster address nothing listens on: ray.init would retry it for
    minutes."""
    where = host_port(address)
    if where is None:
        raise UserError(f"{source} {address!r} is not a Ray cluster address: give {ADDRESS_FORMS}, or drop it to "
                        "start Ray here")
    try:
        socket.create_connection(where, timeout=PREFLIGHT_TIMEOUT_S).close()
    except OSError as exc:
        reason = exc.strerror or f"no answer in {PREFLIGHT_TIMEOUT_S:g} s"
        raise UserError(f"no Ray cluster answers at {address} ({reason}): start the cluster there (ray start "
                        f"--head) or fix {source}") from None


@contextlib.contextmanager
def bounded_gcs_wait():
    """One GCS connect try (unless the user set GCS_WAIT_ENV) while ray.init runs; the environment as it was after."""
    user_set = GCS_WAIT_ENV in os.environ
    os.environ.setdefault(GCS_WAIT_ENV, "1")
    try:
        yield
    finally:
        if not user_set:
            os.environ.pop(GCS_WAIT_ENV, None)


@contextlib.contextmanager
def our_sigterm():
    """ray.init sets a SIGTERM handler that exits at once (sys.exit): the handler before it (rlaif.stopping's, which
    removes the service first) is put back."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)


def connect(address: str | None) -> str | None:
    """ray.init: join the cluster at `address` (or RAY_ADDRESS), or start Ray here when there is none. Returns the
    cluster joined (None: started here). A cluster that is not there ends in one UserError line, in bounded time."""
    import ray

    target, source = target_address(address)
    if target is not None and target != "auto":
        preflight(target, source)
    options = {"include_dashboard": False, "log_to_driver": False, "ignore_reinit_error": True}
    if target is None:  # "local": a Ray of its own, even where `ray start` left a cluster ray.init would join
        with our_sigterm():
            ray.init(address="local", **options)
        return None
    try:
        with bounded_gcs_wait(), our_sigterm():
            ray.init(address=target, **options)
    except (ConnectionError, ValueError, TimeoutError, RuntimeError) as exc:
        problem = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0].rstrip(".")
        raise UserError(f"could not join the Ray cluster at {target} ({source}): {problem}; start the cluster "
                        f"(ray start --head) or fix {source}") from None
    return target


def check_room_here(settings) -> None:
    """Ray started here serves on this machine: its HTTP proxy binds the port (with SO_REUSEPORT, so a second service
    on a port another holds would share it, each answering some of the requests) and its replicas share these cores
    (replicas that do not fit wait unscheduled, silently)."""
    from rlaif.serving.engine import check_bindable

    check_bindable(settings.host, settings.port)
    cpus, wanted = os.cpu_count() or 1, settings.replicas * settings.cpus_per_replica
    if wanted > cpus:
        raise UserError(f"serve.replicas={settings.replicas} x serve.cpus_per_replica={settings.cpus_per_replica:g} "
                        f"needs {wanted:g} CPUs, more than this machine's {cpus} for the Ray started here: lower them, "
                        "or join a cluster with room (--address)")


def run(cfg: PipelineConfig, address: str | None) -> None:
    """Start Ray (or join the cluster at `address`), deploy the service and block until SIGINT/SIGTERM; then remove
    it (and stop Ray when this process started it)."""

    settings = cfg.serve
    if target_address(address)[0] is None:
        check_room_here(settings)
    logging.getLogger("ray.serve").addFilter(_SilenceServesJoinNotice())
    joined = connect(address)  # a cluster's address, RAY_ADDRESS's included; None: Ray started here
    start_serve(settings)
    if joined:
        check_serves_port(settings)
    deploy(cfg, joined)
    replicas = (f"{settings.min_replicas}-{settings.max_replicas} replicas (autoscaling)" if settings.autoscale
                else f"{settings.replicas} replica{'s' * (settings.replicas > 1)}")
    print(f"serving the {settings.model} at {settings.base_url} on Ray Serve, {replicas}; Ctrl-C stops it",
          flush=True)
    stopped = threading.Event()
    with stop_signals(on_first=lambda signum: stopped.set()):  # a second signal cannot break the removal off
        stopped.wait()
        remove_service(settings, joined)


def deploy(cfg: PipelineConfig, joined: str | None) -> None:
    """serve.run until the replicas answer. Replicas that cannot start: one line with their own error, and the
    service removed; Ctrl-C or SIGTERM meanwhile removes it too. A service of that name that was already running
    (an update on a shared cluster) is left to Serve, which keeps its old replicas."""
    settings = cfg.serve
    existed = joined is not None and settings.service_name in serve.status().applications
    try:
        serve.run(application(cfg), name=settings.service_name, route_prefix=settings.route_prefix, blocking=False)
    except BaseException as exc:
        failed = isinstance(exc, RuntimeError) and str(exc).startswith(
            f"Deploying application {settings.service_name} failed")
        reason = (replica_error(settings.service_name) or one_line(exc)) if failed else ""  # read before removal
        if not existed:
            with contextlib.suppress(Exception):  # a controller gone too: the error below is what to show
                remove_service(settings, joined)
        if failed:
            raise UserError(f"the {settings.model} service did not start: {reason}") from None
        raise


def remove_service(settings, joined: str | None) -> None:
    """From a shared cluster only this service; else the Ray started here, Serve with it (serve.shutdown first would
    only add Ray's 'graceful_shutdown failed ... will be retried' line: its controller kills itself)."""
    import ray

    if joined:
        serve.delete(settings.service_name)
    ray.shutdown(wait_for_processes=True)  # the port free (the proxy gone) when `rlaif serve` returns


def replica_error(service_name: str) -> str | None:
    """The replicas' own error from the failed deployment's message in Serve's status; None when Serve says
    nothing."""
    try:
        application_status = serve.status().applications.get(service_name)
    except Exception:  # the controller is gone too: the caller's own error stands
        return None
    messages = [d.message for d in application_status.deployments.values()] if application_status else []
    return next((line for message in messages if (line := exception_line(message or ""))), None)


def exception_line(traceback_text: str) -> str | None:
    """The exception a traceback ends with, as one line: the first unindented line after its last frame. A UserError
    (what ModelServer raises) without its type, any other with its short type name."""
    lines = traceback_text.splitlines()
    frames = [number for number, line in enumerate(lines) if line.lstrip().startswith('File "')]
    after = [line for line in lines[frames[-1] + 1 if frames else 0:] if line.strip() and not line[0].isspace()]
    if not after:
        return None
    kind, colon, text = after[0].partition(": ")
    kind = kind.rsplit(".", 1)[-1]  # rlaif.errors.UserError -> UserError
    if not colon or " " in kind:
        return one_line(after[0])
    return one_line(text if kind == "UserError" else f"{kind}: {text}")

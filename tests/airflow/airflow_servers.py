"""Airflow 3 as its real processes on loopback: `airflow scheduler` (LocalExecutor), `airflow dag-processor` and
`airflow api-server`, with a throwaway AIRFLOW_HOME on SQLite, and the REST calls that drive a DAG run. Used by
tests/airflow/test_scheduler.py and scripts/airflow_screenshot.py; standard library only.

Auth: the simple auth manager with every user an admin (`simple_auth_manager_all_admins`), so the REST API and the
UI need no login: for a loopback test or demo only, never for a shared server."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPONENTS = ("scheduler", "dag-processor", "api-server")
FINISHED = {"success", "failed"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def airflow_env(home: Path, port: int) -> dict[str, str]:
    """The servers' environment: this process's, minus any Airflow settings of its own (the tests' in-process
    AIRFLOW_HOME and unit-test mode), plus one configuration every component shares."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    base = f"http://127.0.0.1:{port}"
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        AIRFLOW__CORE__PARALLELISM="4",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home}/airflow.db",
        AIRFLOW__CORE__AUTH_MANAGER="airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"{base}/execution/",
        AIRFLOW__API__BASE_URL=base,
        # Shared by the scheduler (which signs the tasks' tokens) and the API server (which checks them).
        AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_hex(16),
        AIRFLOW__API__SECRET_KEY=secrets.token_hex(16),
        AIRFLOW__LOGGING__BASE_LOG_FOLDER=str(home / "logs"),
        # The DAG's tasks (and their `rlaif launch` children) import this checkout's rlaif, whatever is installed.
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        RLAIF_WORKDIR=os.environ.get("RLAIF_WORKDIR") or str(REPO),
    )
    return env


@dataclass
class Servers:
    home: Path
    port: int
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, method: str, path: str, body: dict | None = None, ok_404: bool = False):
        """A REST call to /api/v2; the JSON answer (None for a 404 when ok_404)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/api/v2{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            if ok_404 and exc.code == 404:
                return None
            raise RuntimeError(f"{method} {path}: HTTP {exc.code} {exc.read()[:500]!r}") from None

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"airflow {name} exited with {proc.returncode}: see {self.home}/{name}.log "
                                   f"(last lines: {self.tail(name)})")

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.home / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to each component's whole process group (its workers, task processes and their `rlaif launch`
        children), SIGKILL to what is left after 20 s."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.time() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGKILL)  # stragglers in the group, even when its leader has exited
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def airflow_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "airflow", *args]


def start(home: Path, port: int | None = None, timeout: float = 180) -> Servers:
    """Migrate a fresh metadata DB in `home` and start the three components, each in its own process group (logs
    in home/<component>.log); returns when the API server answers."""
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = airflow_env(home, port)
    subprocess.run(airflow_cmd("db", "migrate"), env=env, check=True, capture_output=True, timeout=600)
    servers = Servers(home, port, env)
    args = {"scheduler": ("scheduler",), "dag-processor": ("dag-processor",),
            "api-server": ("api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1")}
    try:
        for name in COMPONENTS:
            with open(home / f"{name}.log", "wb") as log:
                servers.procs[name] = subprocess.Popen(airflow_cmd(*args[name]), env=env, stdout=log,
                                                       stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while True:
            servers.check_alive()
            try:
                servers.api("GET", "/monitor/health")
                return servers
            except (OSError, RuntimeError):
                if time.time() > deadline:
                    raise TimeoutError(f"the API server did not answer in {timeout:.0f}s: "
                                       f"{servers.tail('api-server')}") from None
                time.sleep(1)
    except BaseException:
        servers.stop()
        raise


def wait_for_dag(servers: Servers, dag_id: str, timeout: float = 300) -> dict:
    """The DAG once the dag processor has parsed and stored it; import errors end the wait at once."""
    deadline = time.time() + timeout
    while (dag := servers.api("GET", f"/dags/{dag_id}", ok_404=True)) is None:
        servers.check_alive()
        errors = servers.api("GET", "/importErrors")["import_errors"]
        if errors:
            raise RuntimeError(f"DAG import errors: {errors}")
        if time.time() > deadline:
            raise TimeoutError(f"DAG {dag_id} not parsed in {timeout:.0f}s: {servers.tail('dag-processor')}")
        time.sleep(2)
    return dag


def trigger(servers: Servers, dag_id: str, dag_run_id: str, conf: dict) -> dict:
    """Unpause the DAG and start a run with this conf (the DAG's params), through the REST API."""
    servers.api("PATCH", f"/dags/{dag_id}", {"is_paused": False})
    return servers.api("POST", f"/dags/{dag_id}/dagRuns", {"dag_run_id": dag_run_id, "logical_date": None,
                                                            "conf": conf})


def wait_for_run(servers: Servers, dag_id: str, dag_run_id: str, timeout: float = 600) -> dict:
    """Poll the run until it is finished; returns it (state success or failed)."""
    deadline = time.time() + timeout
    while (run := servers.api("GET", f"/dags/{dag_id}/dagRuns/{dag_run_id}"))["state"] not in FINISHED:
        servers.check_alive()
        if time.time() > deadline:
            raise TimeoutError(f"run {dag_run_id} still {run['state']} after {timeout:.0f}s: "
                               f"{task_states(servers, dag_id, dag_run_id)}")
        time.sleep(3)
    return run


def task_states(servers: Servers, dag_id: str, dag_run_id: str) -> dict[str, str | None]:
    tis = servers.api("GET", f"/dags/{dag_id}/dagRuns/{dag_run_id}/taskInstances")["task_instances"]
    return {ti["task_id"]: ti["state"] for ti in tis}


def task_log(servers: Servers, dag_id: str, dag_run_id: str, task_id: str, try_number: int = 1) -> str:
    """A task's log as text (what the UI shows), for a failing test's message."""
    log = servers.api("GET", f"/dags/{dag_id}/dagRuns/{dag_run_id}/taskInstances/{task_id}/logs/{try_number}"
                             "?full_content=true")
    content = log.get("content") if isinstance(log, dict) else log
    if isinstance(content, list):
        return "\n".join(c.get("event", "") if isinstance(c, dict) else str(c) for c in content)
    return str(content)

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The tests never reach a model hub: hub ids resolve from the Hugging Face cache or fail with a clear error.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def isolated_model_cache(tmp_path_factory):
    """One tiny-policy build per test session, away from the user's cache."""
    cache = tmp_path_factory.mktemp("rlaif-cache")
    old = os.environ.get("RLAIF_CACHE")
    os.environ["RLAIF_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("RLAIF_CACHE", None)
    else:
        os.environ["RLAIF_CACHE"] = old


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint on loopback (moto's server), started and stopped here; yields (endpoint, bucket)."""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe is None:
        pytest.fail("moto_server not found: pip install 'moto[server]' (part of the dev extra)")
    port = _free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    pytest.fail("moto_server did not start")
                time.sleep(0.2)
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="rlaif-test")
        yield endpoint, "rlaif-test"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on loopback (SQLite backend, file artifacts); yields (uri, client)."""
    root = tmp_path_factory.mktemp("mlflow")
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("mlflow not found: pip install 'rlaif[mlflow]' (part of the dev extra)")
    port = _free_port()
    proc = subprocess.Popen([exe, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--default-artifact-root", f"file://{root}/artifacts"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    deadline = time.time() + 120
    while True:
        try:
            client.search_experiments()
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("mlflow server did not start")
            time.sleep(0.5)
    yield uri, client
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)

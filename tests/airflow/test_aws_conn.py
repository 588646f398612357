"""`rlaif_local`'s aws_conn_id: an Airflow `aws` connection resolved when the task runs, its keys, endpoint and region
given to the `rlaif launch` child's environment only; a missing or malformed connection is a one-line failure."""
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk.exceptions import AirflowFailException
from airflow_servers import free_port

REPO = Path(__file__).resolve().parents[2]
SECRET = "S3CR3T-conn-secret-5d1e"


@pytest.fixture(scope="module")
def local_dag():
    return DagBag(dag_folder=str(REPO / "dags" / "rlaif_dags.py")).get_dag("rlaif_local")


def _conn(monkeypatch, conn_id: str, **fields) -> str:
    """A connection the way a deployment may define one: an AIRFLOW_CONN_<ID> variable (JSON)."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields))
    return conn_id


@pytest.mark.parametrize("fields, message", [
    (None, "no such Airflow connection"),
    ({"conn_type": "http", "host": "example.com"}, "connection type is 'http', expected 'aws'"),
    ({"conn_type": "aws", "login": "AKIDEXAMPLE"}, "set both login (access key id) and password"),
    ({"conn_type": "aws", "login": "AKIDEXAMPLE", "password": SECRET, "extra": {"role_arn": "arn:aws:iam::1:role/x"}},
     "unsupported extra ['role_arn']"),
])
def test_bad_connection_fails_in_one_line_without_retries(local_dag, monkeypatch, capfd, fields, message):
    conn_id = _conn(monkeypatch, "rlaif_bad", **fields) if fields else "rlaif_missing"
    run_launch = local_dag.get_task("generate").python_callable
    with pytest.raises(AirflowFailException) as err:  # AirflowFailException: failed at once, never retried
        run_launch(["launch", "generate"], aws_conn_id=conn_id)
    assert message in str(err.value) and "\n" not in str(err.value) and conn_id in str(err.value)
    assert SECRET not in str(err.value) + "".join(capfd.readouterr())


def test_connection_id_is_all_the_template_renders(local_dag):
    task = local_dag.get_task("generate")
    context = {"params": {"aws_conn_id": "minio"}, "dag": local_dag, "task": task,
               "dag_run": SimpleNamespace(run_id="manual__1")}
    assert task.render_template(task.op_kwargs["aws_conn_id"], context) == "minio"


@pytest.fixture
def moto_endpoint():
    """moto's S3 server on loopback, from the rlaif environment ($RLAIF_BIN's venv has the dev extra); no AWS keys in
    this process's environment, so only the connection can give the child any."""
    exe = Path(os.environ["RLAIF_BIN"]).parent / "moto_server"
    if not exe.exists():
        pytest.fail(f"{exe} not found: install rlaif's dev extra in $RLAIF_BIN's environment")
    port = free_port()
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(f"{endpoint}/rlaif-conn", method="PUT"), timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    pytest.fail("moto_server did not start")
                time.sleep(0.3)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _s3_get(endpoint: str, bucket: str, key: str) -> str:
    """A signed GET with boto3 from the rlaif environment (Airflow's has no boto3); moto takes any keys."""
    code = ("import sys, boto3; print(boto3.client('s3', endpoint_url=sys.argv[1]).get_object(Bucket=sys.argv[2], "
            "Key=sys.argv[3])['Body'].read().decode())")
    env = dict(os.environ, AWS_ACCESS_KEY_ID="reader", AWS_SECRET_ACCESS_KEY="reader", AWS_DEFAULT_REGION="us-east-1")
    python = Path(os.environ["RLAIF_BIN"]).parent / "python"
    return subprocess.run([str(python), "-c", code, endpoint, bucket, key], env=env, check=True, capture_output=True,
                          text=True, timeout=60).stdout


@pytest.mark.slow
def test_connection_reaches_only_the_launch_child(local_dag, moto_endpoint, monkeypatch, capfd):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION",
                 "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")  # no ~/.aws either
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    conn_id = _conn(monkeypatch, "rlaif_s3", conn_type="aws", login="AKIDRLAIFTEST", password=SECRET,
                    extra={"endpoint_url": moto_endpoint, "region_name": "us-east-1"})
    task = local_dag.get_task("generate")
    args = ["launch", "generate", "--config", "configs/tiny.yaml", "--set-json", "[]", "--run-id", "conn",
            "--storage-root", "s3://rlaif-conn/runs"]
    events = {task.outlets[0]: SimpleNamespace(extra=None)}  # what Airflow passes as outlet_events
    task.python_callable(args, aws_conn_id=conn_id, outlet_events=events)

    url = "s3://rlaif-conn/runs/conn/generate/manifest.json"
    stored = json.loads(_s3_get(moto_endpoint, "rlaif-conn", "runs/conn/generate/manifest.json"))
    assert events[task.outlets[0]].extra == {"stage": "generate", "run_id": "conn", "digest": stored["digest"],
                                             "url": url}
    assert "AWS_SECRET_ACCESS_KEY" not in os.environ  # the task's own environment is left as it was
    out, err = capfd.readouterr()
    assert f"manifest {url}" in out and SECRET not in out + err

"""Airflow's own environment (.venv-airflow): a throwaway AIRFLOW_HOME on SQLite, the DAGs folder pointing at dags/,
set before Airflow is imported (it reads its configuration at import)."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOME = Path(tempfile.mkdtemp(prefix="rlaif-airflow-"))
# Every pod knob away from its default, so a translation that drops one differs from the pod plan.
(HOME / "cluster.yaml").write_text("""
gpus_per_node: 2
gpu_node_selector: {nvidia.com/gpu.product: H100}
node_selector: {pool: ml}
gpu_tolerations: [{key: nvidia.com/gpu}, {key: team, operator: Equal, value: a}]
env: {AWS_ENDPOINT_URL: "http://minio.minio:9000"}
shm_gib: 16
run_as_user: 1234
service_account: rlaif-runner
namespace: team-a
stages: {evaluate: {cpu: 6, memory_gib: 24}}
""")
os.environ.update(
    AIRFLOW_HOME=str(HOME),
    AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
    AIRFLOW__CORE__LOAD_EXAMPLES="False",
    AIRFLOW__CORE__UNIT_TEST_MODE="True",
    AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{HOME}/airflow.db",
    RLAIF_WORKDIR=str(REPO),  # the local DAG's tasks resolve configs/ and data/ here
    RLAIF_CACHE=str(HOME / "rlaif-cache"),
    RLAIF_CLUSTER_CONFIG=str(HOME / "cluster.yaml"),
    RLAIF_LABEL_JUDGE="rules",  # label's pod then has no GPU
    # Sentinels: if a secret's value ever reached a DAG, a pod spec or a log, the tests below would find it.
    AWS_SECRET_ACCESS_KEY="S3CR3T-value-9f2c",
    RLAIF_JUDGE_API_KEY="S3CR3T-judge-77ab",
)
os.environ.setdefault("RLAIF_BIN", str(REPO / ".venv/bin/rlaif"))
# The `rlaif launch` children import this checkout's rlaif, whichever checkout RLAIF_BIN's venv has installed.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True, timeout=600)


def pytest_unconfigure(config):
    """The throwaway AIRFLOW_HOME goes with the session (one per test run was left in the temp directory)."""
    shutil.rmtree(HOME, ignore_errors=True)

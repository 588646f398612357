"""`rlaif_local` under a real Airflow: scheduler (LocalExecutor), dag processor and API server as processes on
loopback with a SQLite metadata DB, the run started and watched through the REST API, as a user would."""
import json
import time

import pytest
from airflow_servers import start, task_log, task_states, trigger, wait_for_dag, wait_for_run

from rlaif.graph import STAGES

DAG_ID = "rlaif_local"
CONSUMER = "rlaif_on_new_policy"  # dags/rlaif_on_new_policy.py: scheduled on the ppo asset


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    servers = start(tmp_path_factory.mktemp("airflow-servers"))
    try:
        yield servers
    finally:
        servers.stop()


@pytest.mark.slow
def test_scheduler_runs_rlaif_local_and_records_assets(servers, tmp_path):
    dag = wait_for_dag(servers, DAG_ID)
    assert dag["is_paused"] is True  # new DAGs start paused; trigger() unpauses it
    wait_for_dag(servers, CONSUMER)
    servers.api("PATCH", f"/dags/{CONSUMER}", {"is_paused": False})
    conf = {"config": "configs/tiny.yaml", "overrides": ["evaluate.n_prompts=8", "ppo.iterations=1"],
            "run_id": "sched", "storage_root": f"file://{tmp_path}/runs"}
    trigger(servers, DAG_ID, "e2e-1", conf)
    run = wait_for_run(servers, DAG_ID, "e2e-1", timeout=900)
    states = task_states(servers, DAG_ID, "e2e-1")
    if run["state"] != "success":
        failed = [t for t, s in states.items() if s != "success"]
        pytest.fail(f"run {run['state']}: {states}\n" + "\n".join(
            f"--- {t} ---\n{task_log(servers, DAG_ID, 'e2e-1', t)[-3000:]}" for t in failed))
    assert states == {s.name: "success" for s in STAGES}

    run_dir = tmp_path / "runs" / "sched"
    manifests = {s.name: json.loads((run_dir / s.name / "manifest.json").read_text()) for s in STAGES}
    assert all(m["stage"] == name for name, m in manifests.items())
    assert json.loads((run_dir / "evaluate" / "metrics.json").read_text())["n_prompts"] == 8

    events = servers.api("GET", f"/assets/events?source_dag_id={DAG_ID}&source_run_id=e2e-1&limit=50")
    by_task = {e["source_task_id"]: e for e in events["asset_events"]}
    assert set(by_task) == {s.name for s in STAGES}
    for name, event in by_task.items():
        assert event["uri"] == f"rlaif://stages/{name}"
        assert event["extra"]["digest"] == manifests[name]["digest"]
        assert event["extra"]["url"] == f"file://{run_dir}/{name}/manifest.json"
        assert event["extra"]["run_id"] == "sched"
    assert "S3CR3T" not in json.dumps(events)
    # The secrets in the servers' environment (tests/airflow/conftest.py) reach no output and no config
    assert "S3CR3T" not in "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.json"))
    assert "S3CR3T" not in (run_dir / "config.yaml").read_text()

    # The ppo event started the consumer DAG, whose task saw the event's extra.
    deadline = time.time() + 300
    while not (runs := servers.api("GET", f"/dags/{CONSUMER}/dagRuns")["dag_runs"]) and time.time() < deadline:
        time.sleep(3)
    assert len(runs) == 1 and runs[0]["run_type"] == "asset_triggered"
    assert wait_for_run(servers, CONSUMER, runs[0]["dag_run_id"], timeout=300)["state"] == "success"
    xcom = servers.api("GET", f"/dags/{CONSUMER}/dagRuns/{runs[0]['dag_run_id']}/taskInstances/new_policy/"
                              "xcomEntries/return_value?deserialize=true")
    assert xcom["value"] == [by_task["ppo"]["extra"]]

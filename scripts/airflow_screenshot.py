"""Screenshot of `rlaif_local` in the Airflow UI after a finished run, as a person sees it.

    RLAIF_BIN=.venv/bin/rlaif .venv-airflow/bin/python scripts/airflow_screenshot.py --output docs/airflow_grid.png

Starts the scheduler, dag processor and API server on loopback in a throwaway AIRFLOW_HOME (the helpers of the
scheduler test, tests/airflow/airflow_servers.py), runs the tiny config through the DAG, opens the run's page in
headless Chromium and stops everything. A few minutes on a laptop CPU."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "airflow"))

import airflow_servers  # noqa: E402  (the test helpers, on the path just above)

DAG_ID = "rlaif_local"
RUN = "tiny-demo"


def screenshot(url: str, output: Path, size: str) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        sys.exit("error: no Chromium found: apt-get install chromium")
    with tempfile.TemporaryDirectory() as profile:
        # The UI is a single-page app: the virtual-time budget lets it fetch the run and draw before the capture.
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", "--hide-scrollbars", f"--window-size={size}",
                        "--virtual-time-budget=15000", f"--screenshot={output.resolve()}", url],
                       check=True, capture_output=True, timeout=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="docs/airflow_grid.png", help="PNG to write")
    p.add_argument("--window-size", default="1400,900")
    p.add_argument("--path", default=f"/dags/{DAG_ID}/runs/{RUN}",
                   help="UI page to capture, e.g. /dags/rlaif_local/runs/tiny-demo?view=graph ('{run}' allowed)")
    args = p.parse_args()
    os.environ.setdefault("RLAIF_BIN", str(REPO / ".venv/bin/rlaif"))
    work = Path(tempfile.mkdtemp(prefix="rlaif-airflow-shot-"))
    os.environ.setdefault("RLAIF_CACHE", str(work / "rlaif-cache"))
    servers = airflow_servers.start(work / "home")
    try:
        airflow_servers.wait_for_dag(servers, DAG_ID)
        conf = {"config": "configs/tiny.yaml", "overrides": ["evaluate.n_prompts=8", "ppo.iterations=1"],
                "run_id": RUN, "storage_root": f"file://{work}/runs"}
        airflow_servers.trigger(servers, DAG_ID, RUN, conf)
        run = airflow_servers.wait_for_run(servers, DAG_ID, RUN, timeout=900)
        print(f"run {RUN}: {run['state']} {airflow_servers.task_states(servers, DAG_ID, RUN)}")
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        screenshot(servers.url + args.path, output, args.window_size)
        print(f"screenshot: {output}")
    finally:
        servers.stop()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

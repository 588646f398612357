"""Example consumer: a DAG that runs whenever `rlaif` or `rlaif_local` finishes a ppo stage, i.e. publishes a new
policy (the asset `rlaif://stages/ppo`). Not needed to run the pipeline: copy it and put your own step (deploy the
policy, start an evaluation elsewhere) in place of the print. In `rlaif_local` the event's extra holds the run id and
the ppo manifest's URL and digest (the policy lives next to that manifest)."""
from __future__ import annotations

from datetime import datetime, timezone

from airflow.sdk import DAG, Asset, task

NEW_POLICY = Asset("rlaif://stages/ppo")

with DAG(dag_id="rlaif_on_new_policy", schedule=[NEW_POLICY], start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
         catchup=False, tags=["rlaif", "example"], doc_md=__doc__):

    @task
    def new_policy(triggering_asset_events=None) -> list[dict]:
        """One entry per ppo event behind this run (several when they came in faster than runs started)."""
        extras = [dict(event.extra) for event in triggering_asset_events[NEW_POLICY]]
        for extra in extras:
            print(f"new policy: run {extra.get('run_id')}, manifest {extra.get('url')}, digest {extra.get('digest')}")
        return extras

    new_policy()

"""What a retried KFP step learns from its previous attempt. KFP retries every failed step, exit code 2 included
(it cannot retry by exit code): a stage that ran and ended in a user error (a failed quality gate after a whole
evaluation, a diverged update) ran again, twice, to meet the same error. The launcher records such an ending for its
step (the lock owner the KFP component gives it) and the step's automatic retries raise it again at once. Past them
the record is dropped, so a retry the user starts later (after fixing what the message names) runs the stage.
Airflow's tasks are not retried on exit code 2 at all (dags/rlaif_dags.py), and nothing else records."""
from __future__ import annotations

import json
import os

from rlaif.errors import UserError
from rlaif.io import storage

RECORD = "user-error.json"  # in the stage's directory; the stage removes it with the rest when it starts afresh


def _owner() -> str:
    owner = os.environ.get("RLAIF_LOCK_OWNER", "")
    return owner if owner.startswith("kfp:") else ""


def raise_if_repeated(stage_url: str, config_hash: str) -> None:
    """The error this step's previous attempt ended in, for the same settings and inputs, while the cluster's
    automatic retries last; any other record is removed (this attempt runs the stage)."""
    from rlaif.orchestration.cluster import load

    url = storage.join(stage_url, RECORD)
    if not _owner() or not storage.exists(url):
        return
    try:
        record = json.loads(storage.read_text(url))
    except (ValueError, UnicodeDecodeError):
        record = {}
    if (isinstance(record, dict) and (record.get("owner"), record.get("key")) == (_owner(), config_hash)
            and isinstance(record.get("repeats"), int) and record["repeats"] < load().retries):
        storage.write_bytes_atomic(url, json.dumps({**record, "repeats": record["repeats"] + 1}).encode())
        raise UserError(f"{record.get('error')} (this step's previous attempt ran the stage and ended so; an "
                        "automatic retry would meet it again: not run)")
    storage.remove(url)


def record(stage_url: str, config_hash: str, error: str) -> None:
    """Kept for the step's automatic retries (KFP steps only)."""
    if _owner():
        data = json.dumps({"owner": _owner(), "key": config_hash, "error": error, "repeats": 0}).encode()
        storage.write_bytes_atomic(storage.join(stage_url, RECORD), data)

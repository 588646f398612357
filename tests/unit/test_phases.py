"""Each phase's own peak memory (rlaif/phases.py): a phase that holds little after one that held much reads little,
while the process's peak still counts both; a phase in another thread is timed only."""
import sys
import threading

import pytest
import torch

from rlaif.phases import peak_rss_mib, phase, phase_peaks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")

BIG_MIB = 400


def test_a_phase_reads_its_own_peak_and_the_process_keeps_every_phase_s():
    row = {}
    with phase("big", row):
        held = torch.ones(BIG_MIB * 2**18)  # BIG_MIB MiB of float32, touched
        del held
    with phase("small", row):
        kept = torch.ones(2**18)  # 1 MiB
    assert row["big_s"] >= 0 and row["small_s"] >= 0
    assert row["big_rss_mib"] - row["small_rss_mib"] > 0.9 * BIG_MIB  # the second phase's mark started again
    assert peak_rss_mib() >= row["big_rss_mib"] > row["small_rss_mib"] + 0.9 * BIG_MIB
    del kept


def test_a_phase_in_another_thread_is_timed_only():
    row = {}

    def work():
        with phase("rollout", row):
            torch.ones(1000).sum()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "rollout_s" in row and "rollout_rss_mib" not in row


def test_the_summary_takes_each_phase_s_largest_peak():
    rows = [{"update_rss_mib": 900.0, "generate_rss_mib": 500.0}, {"update_rss_mib": 950.0, "generate_rss_mib": 480.0},
            {"update_s": 1.0}]  # an iteration that measured nothing (its rollout in another thread)
    assert phase_peaks(rows, ("generate", "score", "update")) == {
        "phase_peak_rss_mib": {"generate": 500.0, "update": 950.0}}
    assert phase_peaks([{"update_s": 1.0}], ("update",)) == {}


def test_no_phase_peak_is_recorded_where_the_mark_cannot_restart(monkeypatch):
    """A sandbox that refuses clear_refs: the mark would be the process's peak so far, not the phase's own."""
    import rlaif.phases

    monkeypatch.setattr(rlaif.phases, "_restart_peaks", lambda: False)
    row = {}
    with phase("update", row):
        pass
    assert "update_s" in row and "update_rss_mib" not in row

"""Progress in logs: plain lines (no carriage-return frames), at most one per interval plus one at the end, only from
the process that reports."""
from rlaif.progress import LogProgress, progress


def test_plain_lines_in_logs(capsys):
    items = list(progress(range(5), desc="label", unit="pair", every_s=0.0))  # pytest's stderr is not a terminal
    out = capsys.readouterr().out
    assert items == list(range(5)) and "\r" not in out
    lines = out.strip().splitlines()
    assert len(lines) == 6 and lines[-1].startswith("label: 5/5 pair (")  # one per update and one at the end


def test_interval_postfix_and_disabled(capsys):
    bar = LogProgress(None, 100, "train_rm", "step", False, 10, every_s=3600.0)
    for _ in range(90):
        bar.update()
    bar.set_postfix(loss="0.350")
    bar.close()
    bar.close()
    assert capsys.readouterr().out.strip().splitlines() == [capsys_line_of(bar)]
    quiet = LogProgress(iter(range(3)), 3, "ppo", "iter", True, 0, every_s=0.0)
    assert list(quiet) == [0, 1, 2] and capsys.readouterr().out == ""


def capsys_line_of(bar) -> str:
    return (f"train_rm: 100/100 step ({bar.n / (bar.last - bar.start):.2f} step/s, "
            f"{bar.last - bar.start:.0f} s, loss=0.350)")

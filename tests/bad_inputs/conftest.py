"""In-process CLI calls for the bad-input classes (the same `rlaif.cli.main` a shell runs, without a process start
per case): each must end with exit code 2, at most 3 lines on stderr (one here), no traceback, no secret."""
import re

import pytest

from rlaif.cli import main

SECRET = "hunter2-s3cr3t"


@pytest.fixture
def cli(capsys):
    def run(*args: str, needle: str) -> str:
        code = main(list(args))
        out, err = capsys.readouterr()
        lines = [line for line in err.strip().splitlines() if not re.search(r"\d+%\|", line)]
        assert code == 2, (code, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
        assert "Traceback" not in out + err and SECRET not in out + err
        return lines[0]

    return run

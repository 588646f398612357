"""Security rules checked on the code and on everything the project ships or compiles: no secret in a config, a
compiled pipeline, a component or a DAG; weights load from safetensors only; torch.load only with weights_only=True;
remote code never trusted unless the config says so."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECRET_PATTERNS = [
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key id
    re.compile(r"(?i)aws_secret_access_key\s*[:=]\s*['\"]?[A-Za-z0-9/+]{30,}"),
    re.compile(r"sk-[A-Za-z0-9_-]{20,}"),  # OpenAI-style API keys
    re.compile(r"(?i)(api[_-]?key|password|token)\s*[:=]\s*['\"][^'\"$]{8,}['\"]"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
]
SHIPPED = ["configs", "pipelines", "components", "dags", "images", "data/constitution.yaml", "README.md"]


def shipped_files():
    for entry in SHIPPED:
        path = REPO / entry
        yield from ([path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()))


@pytest.mark.parametrize("path", list(shipped_files()), ids=lambda p: str(p.relative_to(REPO)))
def test_no_secret_in_shipped_or_compiled_files(path):
    text = path.read_text(encoding="utf-8", errors="replace")
    for pattern in SECRET_PATTERNS:
        assert not pattern.search(text), f"{path}: looks like a secret ({pattern.pattern})"


def test_the_secret_scan_catches_secrets():
    for leaked in ("key AKIAABCDEFGHIJKLMNOP", "sk-proj-abcdefghijklmnopqrstuv", "password: 'hunter2hunter2'"):
        assert any(p.search(leaked) for p in SECRET_PATTERNS), leaked


def code_lines():
    for path in (REPO / "rlaif").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            yield path.relative_to(REPO), number, line


def test_weights_load_safely():
    for path, number, line in code_lines():
        if "torch.load(" in line:
            assert "weights_only=True" in line, f"{path}:{number}: torch.load without weights_only=True"
        if re.search(r"AutoModel\w*\.from_pretrained\(", line):
            assert "use_safetensors=True" in line, f"{path}:{number}: model loaded without use_safetensors=True"
        assert not re.search(r"trust_remote_code\s*=\s*True", line), (
            f"{path}:{number}: remote code trusted unconditionally")

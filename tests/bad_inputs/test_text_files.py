"""Files that are not the UTF-8 text they claim to be, and files that are not prompts: UTF-16 without a byte-order
mark (NUL bytes) and gzip under a plain name are named as such (config, prompts, constitution alike); a NUL in a
prompt is refused (other control characters are text); a YAML, Markdown or Python file given as prompts is not read
line by line unless data.format=text says so. Each: exit 2, one line, nothing written."""
import gzip
from pathlib import Path

import pytest

TINY = "configs/tiny.yaml"
REPO = Path(__file__).resolve().parents[2]
PROMPTS = "How do I cook rice?\nHow do I keep basil alive?\nHow do I fix a squeaky door?\n"


@pytest.fixture
def root(tmp_path):
    return ("--storage-root", f"file://{tmp_path}/root")


def nothing_written(tmp_path) -> bool:
    return not (tmp_path / "root").exists()


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-16"])
@pytest.mark.parametrize("setting", ["data.prompts", "label.constitution", "--config"])
def test_utf16_text_is_named_as_such(cli, root, tmp_path, encoding, setting):
    source = {"data.prompts": PROMPTS, "label.constitution": (REPO / "data/constitution.yaml").read_text(),
              "--config": (REPO / TINY).read_text()}[setting]
    path = tmp_path / "file.txt"
    path.write_bytes(source.encode(encoding))
    args = ("--config", str(path)) if setting == "--config" else ("--config", TINY, "--set", f"{setting}={path}")
    cli("launch", "generate", *args, *root, needle=f"{path} holds NUL bytes (UTF-16 text, or not a text file): "
                                                    "re-encode it as UTF-8")
    assert nothing_written(tmp_path)


@pytest.mark.parametrize("name", ["prompts.jsonl", "prompts.txt", "prompts"])
def test_gzip_under_a_plain_name_is_named_as_such(cli, root, tmp_path, name):
    path = tmp_path / name
    path.write_bytes(gzip.compress((REPO / "data/prompts.jsonl").read_bytes()))
    cli("launch", "generate", "--config", TINY, *root, "--set", f"data.prompts={path}",
        needle=f"{path} is gzip-compressed: decompress it first (gunzip)")
    assert nothing_written(tmp_path)


def test_a_nul_in_a_prompt_is_refused(cli, root, tmp_path):
    import json

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "hello\u0000world"}) + "\n")
    cli("launch", "generate", "--config", TINY, *root, "--set", f"data.prompts={path}",
        needle=f"prompts file {path} line 2: text holds a NUL character (U+0000)")
    assert nothing_written(tmp_path)


def test_other_control_characters_inside_prompts_stay_valid(tmp_path):
    import json

    from rlaif.config import load_config
    from rlaif.io.prompts import load_prompts

    path = tmp_path / "prompts.jsonl"
    texts = ["a\tb", "line one\nline two", "x\r\ny", "Why does print('\u001b[31mred') show red?", "bell\u0007"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in texts))
    cfg = load_config(TINY, [f"data.prompts={path}"])
    assert [row["prompt"] for row in load_prompts(cfg.data)] == texts  # a question about terminal escapes is one


@pytest.mark.parametrize("path, kind", [("data/constitution.yaml", "YAML"), ("configs/tiny.yaml", "YAML"),
                                        ("README.md", "Markdown"), ("rlaif/cli.py", "Python")])
def test_a_file_that_is_not_prompts_is_not_read_line_by_line(cli, root, tmp_path, path, kind):
    cli("launch", "generate", "--config", TINY, *root, "--set", f"data.prompts={path}",
        needle=f"prompts file {path} looks like {kind}, not prompts")
    assert nothing_written(tmp_path)


def test_data_format_text_reads_any_name_line_by_line(tmp_path):
    from rlaif.config import load_config
    from rlaif.io.prompts import load_prompts

    path = tmp_path / "questions.md"
    path.write_text(PROMPTS)
    cfg = load_config(TINY, [f"data.prompts={path}", "data.format=text"])
    assert [row["prompt"] for row in load_prompts(cfg.data)] == PROMPTS.splitlines()

"""Property-style: random YAML documents (built from the real config's keys, wrong types and odd values) and random
bytes, given as the config and as the prompts file, never crash and never hang: every launch ends with exit 0 or 2
within seconds, never with a traceback."""
import json
import random
import time

import yaml

from rlaif.cli import main
from rlaif.config import PipelineConfig

SECTIONS = {name: list(getattr(field.annotation, "model_fields", {}))
            for name, field in PipelineConfig.model_fields.items()}
ODD = [None, True, -1, 0, 1, 2**70, -2**70, 0.5, 1e308, float("nan"), float("inf"), "", "x", "../..", "s3://",
       "{prompt", "\x00", "é" * 50, [], [1, "a"], {}, {"a": {"b": None}}]


def random_value(rng: random.Random, depth: int = 0):
    if depth < 3 and rng.random() < 0.15:
        return {rng.choice(["a", "name", "text", "judge"]): random_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    if depth < 3 and rng.random() < 0.1:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice(ODD)


def random_config(rng: random.Random) -> str:
    doc = {}
    for _ in range(rng.randint(0, 6)):
        section = rng.choice([*SECTIONS, "bogus"])
        keys = SECTIONS.get(section) or []
        if keys and rng.random() < 0.8:
            doc.setdefault(section, {})
            if isinstance(doc[section], dict):
                doc[section][rng.choice(keys + ["bogus"])] = random_value(rng)
        else:
            doc[section] = random_value(rng)
    return yaml.safe_dump(doc, allow_unicode=True)


def launch(tmp_path, config_path, prompts_path=None, capsys=None) -> None:
    args = ["launch", "label", "--config", str(config_path), "--storage-root", f"file://{tmp_path}/root"]
    if prompts_path:
        args += ["--set", f"data.prompts={prompts_path}"]
    start = time.time()
    code = main(args)
    err = capsys.readouterr().err
    assert code in (0, 2), (code, config_path.read_bytes()[:300], err)
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3 and time.time() - start < 20


def test_random_configs_and_bytes_end_in_exit_0_or_2(tmp_path, capsys):
    rng = random.Random(18)
    config, prompts = tmp_path / "config.yaml", tmp_path / "prompts.jsonl"
    for i in range(120):
        if i % 3 == 2:
            config.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 400))))
        else:
            config.write_text(random_config(rng), encoding="utf-8")
        launch(tmp_path, config, capsys=capsys)
    config.write_text("run_id: fuzz\n")
    for i in range(60):
        if i % 2:
            prompts.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 400))))
        else:
            rows = [json.dumps({"prompt": random_value(rng), "id": random_value(rng), "key_points": random_value(rng)},
                               default=str) if rng.random() < 0.7 else str(random_value(rng))
                    for _ in range(rng.randint(0, 4))]
            prompts.write_text("\n".join(rows), encoding="utf-8")
        launch(tmp_path, config, prompts, capsys=capsys)

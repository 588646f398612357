"""A tiny causal-LM judge built in seconds (random weights: its preferences are arbitrary but deterministic, which is
all the method tests need), and an OpenAI-compatible HTTP server on loopback that serves it (judge_helpers.py)."""
import pytest
from judge_helpers import build_judge_model


@pytest.fixture(scope="session")
def judge_model_dir(tmp_path_factory):
    return build_judge_model(tmp_path_factory.mktemp("judge-model"))

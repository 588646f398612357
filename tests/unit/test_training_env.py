"""Environment handling in the training engine that matters on GPU machines only, checked without one."""
import os

from rlaif import training


def test_deepspeed_arch_list_drops_arch_specific_suffixes(monkeypatch):
    # CUDA images set '9.0a' for Hopper; DeepSpeed's JIT builder parses each entry as numbers and fails on it.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0a+PTX")
    training._deepspeed_arch_list()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0 10.0+PTX"


def test_deepspeed_arch_list_leaves_plain_lists_and_absence_alone(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6;9.0+PTX")
    training._deepspeed_arch_list()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.6;9.0+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    training._deepspeed_arch_list()
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ

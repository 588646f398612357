"""Environment handling in the training engine: GPU-machine settings checked without one, and DeepSpeed outside
torchrun."""
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


def test_deepspeed_trains_in_one_process_outside_torchrun(tmp_path):
    """A one-process stage runs without torchrun (the launcher starts it directly, or a user runs `rlaif stage`):
    DeepSpeed then looked for MPI (mpi4py) and asserted on LOCAL_RANK instead of training."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from rlaif import training
        model = torch.nn.Linear(4, 2)
        engine = training.Engine(model, strategy="deepspeed", zero_stage=2, optimizer="adamw", lr=0.1,
                                 weight_decay=0.0, grad_clip=1.0, accum_steps=1, micro_batch=2, warmup_steps=0,
                                 total_steps=2, device=torch.device("cpu"))
        before = model.weight.detach().clone()
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        assert not torch.equal(engine.model.weight.detach(), before)
        print("stepped")
    """)
    env = {name: value for name, value in os.environ.items()
           if name not in training.WORLD_OF_ONE and not name.startswith(("TORCHELASTIC", "OMPI_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(env, DS_ACCELERATOR="cpu"), cwd=tmp_path)
    assert proc.returncode == 0 and "stepped" in proc.stdout, proc.stderr[-2000:]

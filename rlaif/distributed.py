"""Process-group setup and rank helpers, nanoGPT style: the same stage script runs with and without torchrun."""
from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch.distributed as dist

from rlaif.errors import UserError


def setup() -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Under torchrun: joins the group (nccl on GPUs, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if world > 1 and not os.environ.get(name)]
    if missing:  # WORLD_SIZE left in the environment by another tool: torch would fail deep in its rendezvous
        raise UserError(f"WORLD_SIZE={world} is set but {', '.join(missing)} not: run the stage under torchrun "
                        "(`rlaif launch` does), or unset WORLD_SIZE")
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        # Ranks on one CPU box share its cores; oversubscribing threads makes every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank(), world, device


def avoid_per_shape_attention_plans() -> None:
    """Keeps scaled-dot-product attention off its cuDNN backend, which builds a plan for every new shape: decoding
    (a new key length each step) and length-bucketed batches then spend most of their time building plans (profiled
    on an H100: BENCHMARKS.md). The flash and memory-efficient kernels need no per-shape work."""
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)


def tell_deepspeed_the_device() -> None:
    """DS_ACCELERATOR=cpu where there is no CUDA GPU (the stages then run on the CPU): DeepSpeed otherwise probes
    for an accelerator on import and logs a warning about falling back to the CPU in every process."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def local_device() -> torch.device:
    """This process's GPU (by LOCAL_RANK) when there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def clock() -> float:
    """Wall time once this thread's queued GPU work has run, so timings are not shifted by asynchronous kernels."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return time.perf_counter()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    """`op` over ranks (a copy; the input is unchanged). Identity without a process group."""
    if not dist.is_initialized():
        return t
    out = t.to(_collective_device(), copy=True)  # NCCL reduces only GPU tensors, gloo CPU ones (here)
    dist.all_reduce(out, op=op)
    return out.to(t.device)


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    return _all_reduce(t, dist.ReduceOp.SUM)


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    return _all_reduce(t, dist.ReduceOp.MIN)


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    if not dist.is_initialized() or not values:
        return values
    keys = sorted(values)
    t = all_reduce_sum(torch.tensor([values[k] for k in keys], dtype=torch.float64)) / world_size()
    return dict(zip(keys, t.tolist()))


def teardown() -> None:
    """Leave the group with no collective in flight. A gloo worker thread that finishes a collective frees its
    tensors, which needs the GIL; if that happens while the interpreter is shutting down the thread is cancelled
    inside a C++ destructor and the rank aborts (SIGABRT, "terminate called without an active exception") after its
    work is done; the group can outlive destroy_process_group when something else holds it, as DeepSpeed's engines
    do. So: collect garbage (objects in reference cycles that hold unfinished handles go while Python can free them),
    then a barrier, which gloo runs only after every earlier collective of the group has completed."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def die_with_parent() -> None:
    """A torchrun worker ends when its agent does (Linux: PR_SET_PDEATHSIG). torchrun starts workers in their own
    session, so a kill -9 of the launcher's process group would otherwise leave ranks that keep training and writing
    checkpoints beside the run that resumes."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the agent died before the call: nothing would signal us
        os._exit(1)

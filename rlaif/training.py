"""Training machinery shared by the training stages: DDP or DeepSpeed ZeRO behind one small engine, gradient
accumulation, a warm-up/decay schedule, metrics (JSONL + TensorBoard), and checkpoints that resume exactly.

Checkpoints live under <stage_url>/checkpoints/step-NNNNNNNN/; `checkpoints/latest.json` is written last and is the
commit marker of a checkpoint, like manifest.json is for a stage. A checkpoint made under another config is ignored.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from rlaif import distributed as dist
from rlaif.errors import UserError
from rlaif.io import storage


def warmup_decay(optimizer, warmup_steps: int, total_steps: int | None):
    """Linear warm-up to the peak learning rate, then linear decay to 0 at total_steps (constant when None)."""
    warmup_steps = max(1, warmup_steps)
    if total_steps is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / warmup_steps, max(0.0, (total_steps - s) / max(1, total_steps - warmup_steps)))
    )


def make_optimizer(name: str, params: list, *, lr: float, weight_decay: float, on_gpu: bool):
    """The optimizer a stage's `optimizer` setting names, over `params`. All three take their learning rate from the
    param groups, so `warmup_decay` drives each the same way, and all apply weight decay decoupled from the gradient."""
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # Our learning rate, not Adafactor's own relative step size or parameter-scale multiplier.
        return Adafactor(params, lr=lr, weight_decay=weight_decay, scale_parameter=False, relative_step=False,
                         warmup_init=False)
    if name == "adamw_8bit":
        return _adamw_8bit(params, lr, weight_decay, on_gpu)
    if name != "adamw":
        raise ValueError(f"unknown optimizer {name!r}")
    # Fused on CPUs as on GPUs: one kernel over all tensors, 2.5x faster than the per-tensor loop torch picks on CPUs
    # (0.040 vs 0.100 s a step over 35M parameters, 2 cores); TRL's Trainer uses it too (adamw_torch_fused).
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


def _adamw_8bit(params: list, lr: float, weight_decay: float, on_gpu: bool):
    """bitsandbytes' AdamW with both moments kept in 8 bits (block-wise quantised). Its CPU kernels arrived in 0.50."""
    # On CPUs with AVX512-BF16, importing bitsandbytes warns that an optional 4-bit matmul kernel could not be fetched
    # from a model hub; the 8-bit optimizer does not use it.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise UserError("optimizer adamw_8bit needs bitsandbytes: pip install 'rlaif[bnb]'") from None
    if not on_gpu and tuple(int(part) for part in bitsandbytes.__version__.split(".")[:2]) < (0, 50):
        raise UserError(f"optimizer adamw_8bit on a CPU needs bitsandbytes >= 0.50 (found {bitsandbytes.__version__}): "
                        "pip install 'rlaif[bnb]'")
    return bitsandbytes.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)


def _deepspeed_arch_list() -> None:
    """DeepSpeed's JIT builder parses TORCH_CUDA_ARCH_LIST as numbers and fails on arch-specific entries such as
    '9.0a' (set by CUDA images for Hopper); its fused AdamW needs only the plain architecture."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs and re.search(r"\d[a-z]", archs):
        os.environ["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d)[a-z]+", r"\1", archs)


# torchrun's rendezvous variables for a world of one process
WORLD_OF_ONE = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "0"}


def _deepspeed_world_of_one() -> None:
    """A stage run as one process outside torchrun (the launcher runs a one-process stage without it; `rlaif stage`
    by hand): DeepSpeed reads torchrun's variables, and without them looks for MPI and asserts on LOCAL_RANK. Port 0:
    the only rank's store takes any free port."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        for name, value in WORLD_OF_ONE.items():
            os.environ.setdefault(name, value)


class Engine:
    """One model, its optimizer and schedule, under DDP (default) or DeepSpeed ZeRO-2/3.

    Call `backward(loss)` on every micro-batch and `step()` once the accumulation window is complete."""

    def __init__(self, model, *, strategy: str, zero_stage: int, optimizer: str, lr: float, weight_decay: float,
                 grad_clip: float, accum_steps: int, micro_batch: int, warmup_steps: int, total_steps: int | None,
                 device):
        self.strategy, self.grad_clip, self.accum_steps, self.device = strategy, grad_clip, accum_steps, device
        self.world = dist.world_size()
        self._micro = 0
        params = [p for p in model.parameters() if p.requires_grad]
        on_gpu = device.type == "cuda"
        if strategy == "deepspeed":
            try:
                import deepspeed
            except ImportError:
                raise UserError("strategy 'deepspeed' needs the deepspeed extra: "
                                "pip install 'rlaif[deepspeed]'") from None
            _deepspeed_world_of_one()
            # DeepSpeed's ZeRO calls collectives that this torch deprecates, once per rank and step: nothing a user
            # of rlaif can act on
            warnings.filterwarnings("ignore", category=FutureWarning,
                                    message=".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated")
            ds_config = {
                "train_micro_batch_size_per_gpu": micro_batch,
                "gradient_accumulation_steps": accum_steps,
                "gradient_clipping": grad_clip,
                "zero_optimization": {"stage": zero_stage},
                "zero_allow_untested_optimizer": True,
                "bf16": {"enabled": on_gpu},
                "steps_per_print": 10**9,
            }
            # AdamW on GPUs is DeepSpeed's own fused kernel (JIT on first use); anything else is ours, passed in.
            if on_gpu and optimizer == "adamw":
                ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}}
                _deepspeed_arch_list()
                client_optimizer = None
            else:
                client_optimizer = make_optimizer(optimizer, params, lr=lr, weight_decay=weight_decay, on_gpu=on_gpu)
            self.module, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=client_optimizer, config=ds_config, model_parameters=params,
                lr_scheduler=lambda opt: warmup_decay(opt, warmup_steps, total_steps),
            )
            self.model = self.module.module
        else:
            self.model = model
            self.module = DDP(model) if self.world > 1 else model
            self.optimizer = make_optimizer(optimizer, params, lr=lr, weight_decay=weight_decay, on_gpu=on_gpu)
            self.scheduler = warmup_decay(self.optimizer, warmup_steps, total_steps)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def accumulating(self):
        """DDP all-reduces gradients only on the last micro-batch of an accumulation window."""
        last = (self._micro + 1) % self.accum_steps == 0
        if self.strategy == "ddp" and self.world > 1 and not last:
            with self.module.no_sync():
                yield
        else:
            yield

    def backward(self, loss: torch.Tensor) -> None:
        if self.strategy == "deepspeed":
            # DeepSpeed scales by the accumulation steps itself, and its step() after every micro-batch's backward is
            # what counts micro-batches: ZeRO reduces gradients in the backward that its count says ends the window
            # (two backwards before one step reduced none, and the update failed).
            self.module.backward(loss)
            self.module.step()
        else:
            (loss / self.accum_steps).backward()
        self._micro += 1

    def step(self) -> float:
        """Optimizer step at the end of an accumulation window; returns the gradient norm before clipping. (DeepSpeed
        stepped in each backward: it updated at the window's last one.)"""
        if self._micro % self.accum_steps:  # DeepSpeed would not update, and report the last window's norm
            raise RuntimeError(f"optimizer step after {self._micro % self.accum_steps} of {self.accum_steps} "
                               "micro-batches: a caller must step at the end of a whole accumulation window")
        if self.strategy == "deepspeed":
            norm = self.module.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def replica_spread(self) -> float | None:
        """Max minus min over ranks of a parameter checksum: 0.0 when DDP replicas are identical, as they must be.
        None under DeepSpeed, where parameters or optimizer state are sharded by design."""
        if self.strategy == "deepspeed":
            return None
        with torch.no_grad():
            checksum = torch.stack([p.double().sum() for p in self.model.parameters()]).sum().reshape(1)
        highest = -dist.all_reduce_min(-checksum)
        return (highest - dist.all_reduce_min(checksum)).item()

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    @contextlib.contextmanager
    def full_parameters(self):
        """Inside, every parameter is whole on every rank (ZeRO-3 gathers its partitions)."""
        if self.strategy == "deepspeed" and self.module.zero_optimization_stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
                yield
        else:
            yield

    # --- checkpoints -------------------------------------------------------------------------------------------
    def save(self, local_dir: Path, client_state: dict) -> None:
        local_dir.mkdir(parents=True, exist_ok=True)
        rng = {"torch": torch.get_rng_state(),
               **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
        if self.strategy == "deepspeed":
            self.module.save_checkpoint(str(local_dir), tag="engine", client_state={"client": json.dumps(client_state)})
            torch.save(rng, local_dir / f"rng-rank{dist.rank()}.pt")
            return
        torch.save(rng, local_dir / f"rng-rank{dist.rank()}.pt")
        if dist.rank() == 0:
            # Trainable weights and buffers only: frozen weights (a LoRA base, a reference) are rebuilt from their
            # source.
            keep = ({n for n, p in self.model.named_parameters() if p.requires_grad}
                    | {n for n, _ in self.model.named_buffers()})
            model_state = {k: v for k, v in self.model.state_dict().items() if k in keep}
            torch.save({"model": model_state, "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict()}, local_dir / "engine.pt")
            (local_dir / "client_state.json").write_text(json.dumps(client_state))

    def load(self, local_dir: Path) -> dict:
        rng_file = local_dir / f"rng-rank{dist.rank()}.pt"
        if self.strategy == "deepspeed":
            _, client = self.module.load_checkpoint(str(local_dir), tag="engine")
            state = json.loads(client["client"])
        else:
            saved = torch.load(local_dir / "engine.pt", map_location=self.device, weights_only=True)
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            if missing := sorted(trainable - set(saved["model"])):
                raise UserError(f"checkpoint {local_dir} lacks trainable weights {missing[:3]}: "
                                "delete its checkpoints/ to start over")
            self.model.load_state_dict(saved["model"], strict=False)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            state = json.loads((local_dir / "client_state.json").read_text())
        if rng_file.exists():  # absent when resuming with more ranks than the checkpoint had
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return state


FILE_LIST = "files-rank{rank}.json"  # each rank's files in a checkpoint, with their sha256, written after them


def refuse_diverged(row: dict, names: tuple[str, ...], where: str, fix: str) -> None:
    """Stops a stage whose loss went NaN or infinite: every step after it trains on NaN, and its output, committed,
    would be cached and evaluated as a policy. `row` holds values averaged over ranks, so every rank stops alike."""
    if bad := [name for name in names if name in row and not math.isfinite(row[name])]:
        raise UserError(f"{where}: {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} NaN or infinite (the stage "
                        f"stops; nothing is committed): {fix}")


FLAT_REWARD_STD = 1e-3  # far below any reward that ranks responses: a reward model's are scaled to std 1 on its data


def flat_reward_warning(algorithm: str, reward_std: float, responses: int) -> str | None:
    """A line for a rollout whose rewards barely differ (the std over each process's rows, averaged): PPO's whitened
    advantages, and GRPO's group-scaled ones, of near-equal rewards are rounding noise, which the policy would learn
    from."""
    if reward_std >= FLAT_REWARD_STD:
        return None
    return (f"{algorithm}: warning: the first rollout's rewards barely differ (std {reward_std:.2g} over {responses} "
            "responses): the reward scores these responses alike, and the advantages are rounding noise; check the "
            "reward model (train_rm's held-out accuracy) or the judge ppo.reward names")


SATURATED_ENTROPY = 1e-3  # nats per token: every sampled token's probability is then above ~0.9999


def saturated_sampling_warning(algorithm: str, entropy: float, temperature: float) -> str | None:
    """A line for a first rollout sampled near-deterministically: the gradient of log p(token) is one-hot minus the
    probabilities, ~0 where the sampled token's probability is ~1, so the policy cannot learn from its rewards."""
    if entropy >= SATURATED_ENTROPY:
        return None
    return (f"{algorithm}: warning: the first rollout was sampled near-deterministically (mean entropy "
            f"{entropy:.2g} nats per token at ppo.temperature={temperature:g}): each sampled token's probability is "
            "about 1, so the policy gradient is about 0 and the policy will barely change; raise ppo.temperature "
            "(default 0.7)")


def checkpoint_damage(local: Path, strategy: str) -> str | None:
    """What is wrong with a checkpoint directory as files, or None: the files the engine reads there (DDP), every
    torch file a whole zip archive (one cut short loses its central directory), every JSON file parsing, and every
    file a rank listed there with the checksum it was saved with (bytes changed in place keep the size and the zip
    directory). Checkpoints saved before the lists existed are checked without them."""
    import zipfile

    required = ("engine.pt", "client_state.json") if strategy != "deepspeed" else ()
    if missing := [name for name in required if not (local / name).is_file()]:
        return f"{missing[0]} is missing"
    for path in sorted(local.rglob("*")):
        try:
            if path.suffix == ".pt":
                zipfile.ZipFile(path).close()
            elif path.suffix == ".json":
                json.loads(path.read_text(encoding="utf-8"))
        except (zipfile.BadZipFile, ValueError, OSError) as exc:  # ValueError: not JSON, or not UTF-8
            return f"{path.relative_to(local)}: {storage.first_line(exc)[:80]}"
    return _listed_file_damage(local, dist.rank())


def _listed_file_damage(local: Path, rank: int) -> str | None:
    """The files rank `rank` listed (each rank checks its own list; the ranks then agree): every rank's own list
    alone, not every list on every rank, which would read a large checkpoint once per rank."""
    for listing in sorted(local.glob(FILE_LIST.format(rank=rank))):
        entries = json.loads(listing.read_text(encoding="utf-8"))
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("path"), str)
                                                    for e in entries):
            return f"{listing.name} is not a list of files"
        for entry in entries:
            try:
                matches = storage.sha256_file(local / entry["path"]) == entry.get("sha256")
            except FileNotFoundError:
                return f"{entry['path']} is missing"
            if not matches:
                return f"{entry['path']} does not match the checksum it was saved with"
    return None


class Checkpoints:
    """Where a stage's checkpoints live, which one is current, and keeping only the newest few."""

    def __init__(self, stage_url: str, config_hash: str, keep: int = 2):
        self.url = storage.join(stage_url, "checkpoints")
        self.config_hash, self.keep = config_hash, keep

    def latest(self) -> dict | None:
        """The marker of this config's newest checkpoint; None without one, or where the marker is damaged (it is
        written whole, so only something else cuts it short): the stage then starts afresh, saying so."""
        try:
            marker = json.loads(storage.read_text(storage.join(self.url, "latest.json")))
        except (FileNotFoundError, ValueError):  # ValueError: not JSON, or not UTF-8
            return None
        usable = isinstance(marker, dict) and isinstance(marker.get("name"), str)
        return marker if usable and marker.get("config_hash") == self.config_hash else None

    def save(self, engine: Engine, step: int, client_state: dict) -> None:
        name = f"step-{step:08d}"
        local_root = Path(tempfile.mkdtemp(prefix="rlaif-ckpt-"))
        local = local_root / name
        if dist.rank() == 0 and storage.exists(storage.join(self.url, name)):  # a damaged one the resume passed over
            storage.remove(storage.join(self.url, name), recursive=True)
        dist.barrier()
        try:
            engine.save(local, client_state)
            if local.exists():  # every rank uploads what it wrote (ZeRO shards are per rank), then their list
                files = storage.upload_dir(local, storage.join(self.url, name))
                storage.write_bytes_atomic(storage.join(self.url, name, FILE_LIST.format(rank=dist.rank())),
                                           json.dumps(files).encode())
        finally:  # the stored copy is the checkpoint; keeping this one would fill the local disk
            shutil.rmtree(local_root, ignore_errors=True)
        dist.barrier()
        if dist.rank() == 0:
            previous = self.latest()
            history = [old for old in (previous.get("history", []) if previous else []) if old != name] + [name]
            marker = {"config_hash": self.config_hash, "step": step, "name": name, "history": history[-self.keep:]}
            storage.write_bytes_atomic(storage.join(self.url, "latest.json"), json.dumps(marker).encode())
            for old in history[: -self.keep]:
                storage.remove(storage.join(self.url, old), recursive=True)
        dist.barrier()

    def restore(self, engine: Engine) -> dict | None:
        """Loads the newest checkpoint that loads whole on every rank (a damaged one, cut short or missing a file,
        gives way to the one before it), or None without one; a UserError when none of them loads."""
        marker = self.latest()
        if marker is None:
            return None
        names = [name for name in reversed(marker.get("history") or []) if isinstance(name, str)] or [marker["name"]]
        problems = []
        for name in names:
            state, problem = self._load(engine, name)
            if state is not None:
                if dist.rank() == 0:
                    instead = f", as {', '.join(problems)}" if problems else ""
                    print(f"resumed from checkpoint {name} (step {int(name.removeprefix('step-'))}){instead}",
                          flush=True)
                return state
            problems.append(f"{name} is damaged ({problem})")
        raise UserError(f"no checkpoint under {self.url} loads ({'; '.join(problems)[:300]}): run the stage again from "
                        "its start (`rlaif run --rerun STAGE`, or `rlaif launch STAGE --rerun`)")

    def _load(self, engine: Engine, name: str) -> tuple[dict | None, str]:
        """(state, "") where checkpoint `name` is whole on every rank, then loaded; else (None, why not). Whole is
        decided before any rank loads (a DeepSpeed load runs collectives, which a rank that failed alone would leave
        waiting); a failure past that check (storage, memory) is raised, not taken for damage."""
        remote = storage.join(self.url, name)
        files = [{"path": name, "sha256": None} for name in storage.list_files(remote)]
        local = storage.download_dir(remote, files)
        problem = checkpoint_damage(local, engine.strategy)
        whole = dist.all_reduce_min(torch.tensor([0.0 if problem else 1.0])).item() == 1.0  # one answer for all ranks
        if not whole:
            return None, problem or "on another rank"
        return engine.load(local), ""

"""The optimizers a training stage can name (train_rm.optimizer, ppo.optimizer) under the shared Engine: each one
trains a tiny model, keeps the state it is chosen for, and resumes from a checkpoint to the step an uninterrupted run
takes. adamw_8bit runs where bitsandbytes is installed (the `bnb` extra, not part of the dev install)."""
import importlib.util
import sys
import types

import pytest
import torch

from rlaif.errors import UserError
from rlaif.training import Engine, make_optimizer

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
OPTIMIZERS = ["adamw", "adafactor",
              pytest.param("adamw_8bit", marks=pytest.mark.skipif(not HAS_BNB, reason="needs the bnb extra"))]
CPU = torch.device("cpu")


def regression(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A two-layer net and a fixed target function: its first layer (64 x 128) is large enough for 8-bit state."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    x = torch.randn(256, 64)
    return model, x, torch.sin(x[:, :8].sum(dim=1, keepdim=True))


def engine_for(model: torch.nn.Module, optimizer: str, total_steps: int = 100) -> Engine:
    return Engine(model, strategy="ddp", zero_stage=2, optimizer=optimizer, lr=1e-2, weight_decay=0.01,
                  grad_clip=1.0, accum_steps=1, micro_batch=32, warmup_steps=5, total_steps=total_steps, device=CPU)


def train(engine: Engine, x: torch.Tensor, y: torch.Tensor, steps: range) -> list[float]:
    losses = []
    for step in steps:
        batch = slice(step * 32 % len(x), step * 32 % len(x) + 32)
        loss = torch.nn.functional.mse_loss(engine(x[batch]), y[batch])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_each_optimizer_trains_under_the_engine(optimizer):
    model, x, y = regression()
    engine = engine_for(model, optimizer)
    with torch.no_grad():
        before = torch.nn.functional.mse_loss(model(x), y).item()
    train(engine, x, y, range(60))
    with torch.no_grad():
        after = torch.nn.functional.mse_loss(model(x), y).item()
    assert after < 0.5 * before, (before, after)
    assert engine.lr() == pytest.approx(1e-2 * 40 / 95)  # the warm-up/decay schedule drives every optimizer's rate


def state_bytes(optimizer) -> int:
    return sum(t.nbytes for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))


@pytest.mark.parametrize("optimizer", OPTIMIZERS[1:])
def test_lean_optimizers_keep_a_fraction_of_adamw_state(optimizer):
    sizes = {}
    for name in ("adamw", optimizer):
        model, x, y = regression()
        engine = engine_for(model, name)
        train(engine, x, y, range(1))
        sizes[name] = state_bytes(engine.optimizer)
    weight_state = engine.optimizer.state[model[0].weight]
    if optimizer == "adafactor":  # no first moment; the 64 x 128 matrix keeps a row and a column of second moments
        assert "exp_avg" not in weight_state and weight_state["exp_avg_sq_row"].shape == (128,)
        assert sizes[optimizer] < 0.05 * sizes["adamw"]
    else:  # both moments as uint8 codes (2 of AdamW's 8 bytes), plus a scale per block and a code map per tensor;
        # tensors under 4096 elements (the biases here) keep 32-bit moments
        assert weight_state["state1"].dtype == weight_state["state2"].dtype == torch.uint8
        assert sizes[optimizer] < 0.35 * sizes["adamw"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_checkpoint_resumes_to_the_uninterrupted_weights(optimizer, tmp_path):
    model, x, y = regression()
    straight = engine_for(model, optimizer)
    train(straight, x, y, range(12))

    first, _, _ = regression()
    interrupted = engine_for(first, optimizer)
    train(interrupted, x, y, range(6))
    interrupted.save(tmp_path, {"step": 6})
    fresh, _, _ = regression(seed=1)  # other initial weights: the checkpoint must restore everything that matters
    resumed = engine_for(fresh, optimizer)
    assert resumed.load(tmp_path) == {"step": 6}
    train(resumed, x, y, range(6, 12))
    for got, expected in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(got, expected)
    assert resumed.lr() == straight.lr()


def test_adamw_8bit_without_bitsandbytes_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(UserError, match=r"adamw_8bit needs bitsandbytes: pip install 'rlaif\[bnb\]'"):
        make_optimizer("adamw_8bit", [torch.nn.Parameter(torch.zeros(2))], lr=1e-3, weight_decay=0.0, on_gpu=False)


def test_adamw_8bit_on_a_cpu_with_a_bitsandbytes_before_its_cpu_kernels_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.SimpleNamespace(__version__="0.49.2"))
    with pytest.raises(UserError, match=r"on a CPU needs bitsandbytes >= 0.50 \(found 0.49.2\)"):
        make_optimizer("adamw_8bit", [torch.nn.Parameter(torch.zeros(2))], lr=1e-3, weight_decay=0.0, on_gpu=False)


def test_an_unknown_optimizer_name_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(2))], lr=1e-3, weight_decay=0.0, on_gpu=False)

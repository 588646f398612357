"""The fused CPU kernels (rlaif/models/cpu_kernels.py) against the plain PyTorch expressions they replace, forward
and backward, and whole Llama-family models with them against the same models without them."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rlaif.models import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: the kernels are not built")


def eager_rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def eager_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def grads(fn, inputs, upstream):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    out.backward(upstream)
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def assert_close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 37, 72), (1, 70, 512), (5, 33)])  # widths and row counts off the 16/32 grid
@pytest.mark.parametrize("train_weight", [True, False])
def test_rms_norm_matches_eager(shape, train_weight):
    torch.manual_seed(0)
    x, weight, upstream = torch.randn(shape), torch.randn(shape[-1]).requires_grad_(train_weight), torch.randn(shape)
    fused, fused_grads = grads(lambda a, w: cpu_kernels._RMSNorm.apply(a, w, 1e-6), [x.requires_grad_(), weight],
                               upstream)
    plain, plain_grads = grads(lambda a, w: eager_rms(a, w, 1e-6), [x, weight], upstream)
    assert_close(fused, plain)
    assert len(fused_grads) == len(plain_grads) == 1 + train_weight
    for got, want in zip(fused_grads, plain_grads):
        assert_close(got, want)


def test_swiglu_matches_eager():
    torch.manual_seed(0)
    gate, up = torch.randn(4, 19, 77) * 6, torch.randn(4, 19, 77)  # gates far into both tails of the sigmoid
    gate[0, 0, :3] = torch.tensor([-200.0, 200.0, 0.0])
    upstream = torch.randn_like(gate)
    fused, fused_grads = grads(cpu_kernels._SwiGLU.apply, [gate.requires_grad_(), up.requires_grad_()], upstream)
    plain, plain_grads = grads(lambda g, u: F.silu(g) * u, [gate, up], upstream)
    assert_close(fused, plain)
    for got, want in zip(fused_grads, plain_grads):
        assert_close(got, want)


@pytest.mark.parametrize("cos_rows", [2, 1])  # one cos row per token, or one per position shared by the batch
def test_rotary_is_transformers_rotary_to_the_bit(cos_rows):
    """q as attention makes it: [batch, seq, heads, d] projections viewed as [batch, heads, seq, d]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    original = getattr(apply_rotary_pos_emb, "__wrapped__", apply_rotary_pos_emb)
    torch.manual_seed(0)
    q, k = torch.randn(2, 11, 3, 10).transpose(1, 2), torch.randn(2, 11, 3, 10).transpose(1, 2)
    cos, sin = torch.randn(cos_rows, 11, 10), torch.randn(cos_rows, 11, 10)
    upstream = torch.randn(2, 3, 11, 10)
    fused, (fused_grad,) = grads(lambda a: cpu_kernels._Rotary.apply(a, cos, sin), [q.requires_grad_()], upstream)
    plain, (plain_grad,) = grads(lambda a: original(a, k, cos, sin)[0], [q], upstream)
    assert fused.stride() == q.stride()  # the layout attention expects back
    assert torch.equal(fused, plain) and torch.equal(fused_grad, plain_grad)


def kernel_outputs(threads: int, x, weight, gate, up, upstream_norm, upstream_mlp):
    """RMSNorm's and SwiGLU's outputs and gradients under `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        norm = grads(lambda a, w: cpu_kernels._RMSNorm.apply(a, w, 1e-6),
                     [x.requires_grad_(), weight.requires_grad_()], upstream_norm)
        swiglu = grads(cpu_kernels._SwiGLU.apply, [gate.requires_grad_(), up.requires_grad_()], upstream_mlp)
    finally:
        torch.set_num_threads(before)
    return [norm[0], *norm[1], swiglu[0], *swiglu[1]]


def test_same_bits_whatever_the_threads_and_wherever_a_row_sits():
    """Sums in a fixed order and one exp for every element: one thread or two, and a row alone or in a batch (at any
    offset from a vector boundary), give identical results."""
    torch.manual_seed(0)
    x, weight, upstream_norm = torch.randn(70, 200), torch.randn(200), torch.randn(70, 200)
    gate, up, upstream_mlp = torch.randn(37, 77) * 4, torch.randn(37, 77), torch.randn(37, 77)
    one, two = (kernel_outputs(threads, x, weight, gate, up, upstream_norm, upstream_mlp) for threads in (1, 2))
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    row = 5
    alone = kernel_outputs(1, x[row:row + 1].detach().clone(), weight.detach(), gate[row:row + 1].detach().clone(),
                           up[row:row + 1].detach().clone(), upstream_norm[row:row + 1], upstream_mlp[row:row + 1])
    norm_out, norm_dx, _, mlp_out, mlp_dgate, mlp_dup = one
    for batched, single in zip((norm_out, norm_dx, mlp_out, mlp_dgate, mlp_dup), (alone[0], alone[1], *alone[3:])):
        assert torch.equal(batched[row], single[0])


def tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=120)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # qwen3: per-head q/k norms
def test_a_fused_model_computes_what_the_model_computes(model_type):
    plain = tiny(model_type)
    fused = copy.deepcopy(plain)
    assert cpu_kernels.fuse(fused, "cpu") == 2 * 2 + 1 + 2 + (2 * 2 if model_type == "qwen3" else 0)
    ids = torch.randint(0, 120, (3, 17))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a left-padded row
    outputs = [model(input_ids=ids, attention_mask=mask).logits for model in (plain, fused)]
    assert_close(outputs[1], outputs[0])
    for logits in outputs:
        logits.square().mean().backward()
    for (name, want), got in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert type(copy.deepcopy(fused).model.norm) is type(fused.model.norm)  # the frozen reference copy stays fused


def test_the_lean_decode_step_still_takes_a_fused_model():
    """The CPU sampler's lean step reads the norms' weights itself: a fused model is still one it knows."""
    from rlaif.models.lean_decode import lean_decode_step

    model = tiny("qwen3").eval()
    cpu_kernels.fuse(model, "cpu")
    assert lean_decode_step(model) is not None


def test_calls_the_kernels_cannot_take_run_the_model_code():
    """bf16 weights and autocast take the model's own forward (same output as an unfused model)."""
    plain = tiny("llama").to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    cpu_kernels.fuse(fused, "cpu")
    ids = torch.randint(0, 120, (2, 9))
    assert torch.equal(fused(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_gpu_models_are_left_alone():
    model = tiny("llama")
    assert cpu_kernels.fuse(model, "cuda") == 0 and type(model.model.norm).__name__ == "LlamaRMSNorm"


@pytest.mark.parametrize("setting, needle", [
    ({"CC": "/bin/false"}, "fused CPU kernels unavailable"),  # no working compiler: said once, layers run as before
    ({"RLAIF_CPU_KERNELS": "off"}, ""),
])
def test_without_the_kernels_models_run_their_own_layers(tmp_path, setting, needle):
    script = ("import torch; from transformers import LlamaConfig, LlamaForCausalLM; "
              "from rlaif.models.cpu_kernels import fuse; "
              "m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
              "num_attention_heads=2, vocab_size=50)); "
              "print('switched', fuse(m, 'cpu'), fuse(m, 'cpu')); m(input_ids=torch.tensor([[1, 2, 3]]))")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), **setting}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "switched 0 0" in done.stdout
    assert done.stderr.count("fused CPU kernels unavailable") == (1 if needle else 0), done.stderr
    assert not list(tmp_path.rglob("*.so*"))  # nothing half-built left


def test_a_cache_folder_that_cannot_be_written_falls_back_to_the_temp_directory(tmp_path):
    """A pod whose home (torch's default cache) is read-only still gets the kernels, built under its temp dir."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(blocked / "below"), "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    script = "from rlaif.models.cpu_kernels import library; print('built', library() is not None)"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "built True" in done.stdout, done.stderr
    assert len(list((tmp_path / "tmp").glob("rlaif_cpu_kernels_*/*.so"))) == 1

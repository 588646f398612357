"""Fused CPU kernels for a Llama-family decoder's element-wise parts: RMSNorm, SiLU(gate) x up and the rotary
embedding, forward and backward, each one pass over memory where eager PyTorch makes 4-12 (cpu_kernels.c).

On a CPU in fp32 these parts cost about a third of a PPO update at 28M parameters once the matrix products run near
the machine's peak (BENCHMARKS.md). torch.compile does not help there (packed rows change shape every minibatch:
recompiles, or slower dynamic-shape code), so the kernels are plain C, built once per machine with its C compiler
(about a second; cached under TORCH_EXTENSIONS_DIR, as torch caches its own extensions) and called through ctypes.
Where no compiler is found or the build fails, one line says so and the model's own forward runs: the same results
to fp32 rounding (the rotary embedding to the bit), a little slower. They run only on dense CPU fp32 tensors outside
autocast and torch.compile (ZeRO-3 included: its hooks gather a norm's weight around the module's forward and
backward as for the model's own layers); every other call takes the model's own code. RLAIF_CPU_KERNELS=off turns
them off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from rlaif.config.loading import switch

SOURCE = Path(__file__).with_suffix(".c")
NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}  # weight * x * rsqrt(mean(x^2) + eps)
MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}  # down(act(gate(x)) * up(x))
SILU = {"SiLU", "SiLUActivation"}  # torch's, and transformers' for hidden_act silu / swish
ROTARY_MODULES = ("llama", "mistral", "qwen2", "qwen3")  # transformers.models.<name>.modeling_<name>
BLOCK = 32  # rows per partial sum of the RMSNorm weight gradient: fixed, so the sum's order is too


def _flags() -> list[str]:
    # IEEE arithmetic, no fused multiply-adds (a loop's vector body and scalar tail then round alike); 512-bit vectors
    # where the CPU has them (GCC's default for -march=native stops at 256).
    flags = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
             "-Wl,--no-undefined"]
    return flags + (["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else [])


def _compiler() -> tuple[str, str]:
    """(the C compiler, its version line): a cached library built by another compiler is not this one's."""
    compiler = os.environ.get("CC", "cc")
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True)
    return compiler, done.stdout.partition("\n")[0]


def _cpu_flags() -> str:
    """The CPU's feature list: -march=native builds for it, so a cache shared by different machines keys on it."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _cache_dirs() -> list[Path]:
    """Where the library is cached: TORCH_EXTENSIONS_DIR (or torch's default under the home directory), else the
    machine's temp directory (a pod whose home directory is read-only)."""
    from rlaif.scratch import machine_temp_dir

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "torch_extensions")
    return [Path(root) / "rlaif_cpu_kernels", Path(machine_temp_dir()) / f"rlaif_cpu_kernels_{os.getuid()}"]


def _build(target: Path, compiler: str) -> None:
    """Compile to a private name, then rename: ranks building at once each publish a whole library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        subprocess.run([compiler, *_flags(), str(SOURCE), "-o", partial, "-lm"], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)


def _why(error: Exception) -> str:
    """The line that says what went wrong: a compiler's first error, else the exception."""
    lines = (getattr(error, "stderr", None) or "").splitlines()
    return next((line.strip() for line in lines if "error" in line), str(error).strip() or type(error).__name__)


def _load() -> ctypes.CDLL:
    compiler, version = _compiler()
    key = hashlib.sha256("\n".join([SOURCE.read_text(), *_flags(), compiler, version, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    *earlier, last = _cache_dirs()
    for folder in (*earlier, last):
        target = folder / f"rlaif_cpu_kernels_{key}.so"
        try:
            if not target.exists():
                _build(target, compiler)
            return ctypes.CDLL(str(target))
        except OSError:  # not writable (a read-only home in a pod), or a damaged file there: the next place
            if folder == last:
                raise


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None (RLAIF_CPU_KERNELS=off, or no working compiler: said once)."""
    if switch("RLAIF_CPU_KERNELS") == "off":
        return None
    try:
        lib = _load()
    except (OSError, subprocess.SubprocessError) as error:
        print(f"fused CPU kernels unavailable ({_why(error)}): the models' own layers run instead (they need a C "
              "compiler, `cc` or $CC, and a writable TORCH_EXTENSIONS_DIR)", file=sys.stderr, flush=True)
        return None
    pointer, size, threads = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.rms_norm_forward.argtypes = [pointer] * 4 + [size, size, ctypes.c_float, threads]
    lib.rms_norm_backward.argtypes = [pointer] * 7 + [size, size, size, threads]
    lib.swiglu_forward.argtypes = [pointer] * 3 + [size, threads]
    lib.swiglu_backward.argtypes = [pointer] * 5 + [size, threads]
    lib.rotary.argtypes = [pointer] * 4 + [size, size, size, size, threads, threads]
    return lib


def _ptr(tensor: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr() if tensor is not None else None)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors: dense fp32 on the CPU, not empty, outside autocast and
    torch.compile, the library built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.layout == torch.strided and t.numel()
                for t in tensors)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and library() is not None)


# Their backwards are not differentiable again (create_graph=True raises instead of giving wrong second derivatives).
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x = x.contiguous()
        rows, width = x.numel() // x.shape[-1], x.shape[-1]
        y, rstd = torch.empty_like(x), x.new_empty(rows)
        library().rms_norm_forward(_ptr(x), _ptr(weight), _ptr(y), _ptr(rstd), rows, width, eps,
                                   torch.get_num_threads())
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        rows, width = rstd.numel(), x.shape[-1]
        if weight.numel() != width:  # a partitioned weight left ungathered: never read past its end
            raise RuntimeError(f"RMSNorm backward: the weight holds {weight.numel()} values for width {width}")
        dx = torch.empty_like(x)
        wants_weight = ctx.needs_input_grad[1]
        partial = x.new_empty((rows + BLOCK - 1) // BLOCK, width) if wants_weight else None
        dweight = torch.empty_like(weight) if wants_weight else None
        library().rms_norm_backward(_ptr(dy), _ptr(x), _ptr(weight), _ptr(rstd), _ptr(dx), _ptr(partial),
                                    _ptr(dweight), rows, width, BLOCK, torch.get_num_threads())
        return dx, dweight, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        library().swiglu_forward(_ptr(gate), _ptr(up), _ptr(out), gate.numel(), torch.get_num_threads())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        library().swiglu_backward(_ptr(dout), _ptr(gate), _ptr(up), _ptr(dgate), _ptr(dup), gate.numel(),
                                  torch.get_num_threads())
        return dgate, dup


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [batch, heads, seq, d], usually laid out as [batch, seq, heads, d] (how attention's projections come),
    cos/sin [batch or 1, seq, d] contiguous; the result has that layout."""
    tokens = x.transpose(1, 2).contiguous()
    out = torch.empty_like(tokens)
    shared_rows = tokens.shape[1] if cos.shape[0] == 1 else 0  # one cos row per position, for every sequence
    library().rotary(_ptr(tokens), _ptr(cos), _ptr(sin), _ptr(out), tokens.shape[0] * tokens.shape[1],
                     tokens.shape[2], tokens.shape[3], shared_rows, int(backward), torch.get_num_threads())
    return out.transpose(1, 2)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, backward=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        cos, sin = ctx.saved_tensors
        return _rotate(dout, cos, sin, backward=True), None, None


def rms_norm(module, hidden: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if applies(hidden, weight) and weight.shape == hidden.shape[-1:] and weight.is_contiguous():
        return _RMSNorm.apply(hidden, weight, float(module.variance_epsilon))
    return own_class(module).forward(module, hidden)


def mlp(module, x: torch.Tensor) -> torch.Tensor:
    gate, up = module.gate_proj(x), module.up_proj(x)
    if applies(gate, up) and gate.shape == up.shape:
        return module.down_proj(_SwiGLU.apply(gate, up))
    return module.down_proj(module.act_fn(gate) * up)


def _rotary_applies(q, k, cos, sin, unsqueeze_dim, kwargs) -> bool:
    """q, k [batch, heads, seq, d] and cos, sin [batch or 1, seq, d], as Llama-family attention calls it."""
    return (not kwargs and unsqueeze_dim == 1 and q.dim() == k.dim() == 4 and cos.dim() == 3
            and cos.shape == sin.shape and cos.shape[0] in (1, q.shape[0]) and q.shape[0] == k.shape[0]
            and cos.shape[1] == q.shape[2] == k.shape[2] and cos.shape[2] == q.shape[3] == k.shape[3]
            and q.shape[3] % 2 == 0 and not (cos.requires_grad or sin.requires_grad) and applies(q, k, cos, sin))


def _rotary_wrapper(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if _rotary_applies(q, k, cos, sin, unsqueeze_dim, kwargs):
            cos, sin = cos.contiguous(), sin.contiguous()
            return _Rotary.apply(q, cos, sin), _Rotary.apply(k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim, **kwargs)

    apply_rotary_pos_emb.rlaif_fused = True
    return apply_rotary_pos_emb


def _install_rotary() -> None:
    """The attention layers of these models call their module's apply_rotary_pos_emb: wrap it once per process (the
    wrapper hands every call it cannot take to the original)."""
    import importlib

    for name in ROTARY_MODULES:
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:  # a transformers release without this architecture
            continue
        if not getattr(module.apply_rotary_pos_emb, "rlaif_fused", False):
            module.apply_rotary_pos_emb = _rotary_wrapper(module.apply_rotary_pos_emb)


@functools.cache
def _fused_class(base: type, kind: str) -> type:
    forward = rms_norm if kind == "norm" else mlp
    return type(f"Fused{base.__name__}", (base,), {"forward": forward, "__module__": __name__, "rlaif_fused": True})


def own_class(module: torch.nn.Module) -> type:
    """The model's own class of a module, whether or not fuse() switched it."""
    return type(module).__mro__[1] if getattr(type(module), "rlaif_fused", False) else type(module)


def fuse(model: torch.nn.Module, device) -> int:
    """Switch the model's RMSNorms and SiLU MLPs to the fused kernels (each call still falls back to the model's own
    forward where they cannot run) and wrap the rotary embedding; the number of modules switched. Nothing changes
    for a model that runs on a GPU (`device`), or when the kernels are off or cannot be built."""
    if torch.device(device).type != "cpu" or library() is None:
        return 0
    switched = 0
    for module in model.modules():
        name = type(module).__name__
        if name in NORMS and hasattr(module, "variance_epsilon"):
            module.__class__ = _fused_class(type(module), "norm")
        elif name in MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU:
            module.__class__ = _fused_class(type(module), "mlp")
        else:
            continue
        switched += 1
    if switched:
        _install_rotary()
    return switched

"""Model directories as files: checked cheaply, without loading weights (the layout a Hugging Face directory needs,
JSON that parses, safetensors that are whole), and written by every export (tokenizer and weights). Below
models/loading.py, models/tiny.py and the stages, which use it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from rlaif.errors import UserError

# Weights saved with pickle (torch.save): never loaded, since unpickling can run code.
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def check_model_dir(path: Path, what: str) -> Path:
    if path.is_file():
        raise UserError(f"{what} {path} is a file: give the Hugging Face model directory that holds it "
                        f"({path.parent})")
    if not path.is_dir():
        hub = f"org/name or hf://{path}" if len(path.parts) == 1 and not path.is_absolute() else "org/name"
        raise UserError(f"{what} directory not found: {path} (give a Hugging Face model directory, or a hub model as "
                        f"{hub})")
    if not (path / "config.json").exists():
        if (path / "adapter_config.json").exists():
            raise UserError(f"{what} directory {path} holds a PEFT adapter, not a whole model: merge it into its base "
                            "model (PeftModel.from_pretrained(base, dir).merge_and_unload()) and save_pretrained the "
                            "result with its tokenizer")
        raise UserError(f"{what} directory {path} has no config.json: it is not a Hugging Face model directory")
    if not any(path.glob("*.safetensors")):
        if any(any(path.glob(pattern)) for pattern in PICKLED_WEIGHTS):
            raise UserError(f"{what} directory {path} has no .safetensors weights, only pickled ones (loaded by none "
                            "of the stages: they could run code): convert it with "
                            "save_pretrained(safe_serialization=True)")
        raise UserError(f"{what} directory {path} has no weights (no .safetensors files): save the model into it "
                        "with save_pretrained, or name the directory that holds them")
    return path


def check_model_files(path: Path, what: str) -> Path:
    """Beyond check_model_dir, cheaply and without loading weights: config.json is a JSON object, a tokenizer file is
    there and its JSON files parse, and every .safetensors file is whole (safetensors_intact)."""
    check_model_dir(path, what)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict):
        raise UserError(f"{what} directory {path}: config.json is not a JSON object: re-export the model")
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise UserError(f"{what} directory {path} has no tokenizer files: save the tokenizer with the model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (path / name).exists() and not isinstance(_json_or_none(path / name), dict):
            raise UserError(f"{what} directory {path}: {name} is not a JSON object (truncated?): save the tokenizer "
                            "again")
    check_shard_index(path, what)
    for weights in sorted(path.glob("*.safetensors")):
        if not safetensors_intact(weights):
            raise UserError(f"{what} weights {weights} are not valid safetensors (a bad header, or the file is "
                            "shorter or longer than its tensors: truncated?): re-export the model")
    return path


def check_shard_index(path: Path, what: str) -> None:
    """A sharded checkpoint's model.safetensors.index.json parses and every shard it names is in the directory: a
    missing shard is otherwise found only when a stage loads the weights, after the stages before it ran."""
    index_file = path / "model.safetensors.index.json"
    if not index_file.exists():
        return
    index = _json_or_none(index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise UserError(f"{what} directory {path}: model.safetensors.index.json has no weight_map of tensor names to "
                        "shard files (truncated?): re-export the model")
    missing = sorted({name for name in weight_map.values() if not (path / name).is_file()})
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"{what} directory {path}: shard {missing[0]}{more}, named in model.safetensors.index.json, is "
                        "not there: copy the whole checkpoint")


def _json_or_none(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def safetensors_intact(weights: Path) -> bool:
    """Without reading the tensors: an 8-byte header length, that much JSON, and tensor data that ends exactly at the
    end of the file (what safetensors checks on load, as "file not fully covered")."""
    size = weights.stat().st_size
    with open(weights, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            return False
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return False
    if not isinstance(header, dict):
        return False
    offsets = [entry.get("data_offsets") if isinstance(entry, dict) else None
               for key, entry in header.items() if key != "__metadata__"]
    if not all(isinstance(pair, list) and len(pair) == 2 and all(type(end) is int for end in pair) for pair in offsets):
        return False
    return 8 + length + max((end for _, end in offsets), default=0) == size


def save_tokenizer(tokenizer, out) -> None:
    """save_pretrained without the truncation and padding its last call left in the fast backend: tokenizer.json
    would hold the last batch's settings, so a run resumed after its last step (no batch since loading) wrote another
    file than the run that was not interrupted, and its digest sent the stages after it to run again. Every call
    passes its own padding and truncation, so none reads these."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()
    tokenizer.save_pretrained(out)


def save_model(model, out, **options) -> None:
    """save_pretrained as safetensors, without importing DeepSpeed: transformers unwraps a model through accelerate,
    which imports DeepSpeed (about 2 s) wherever it is installed only to ask whether the model is a DeepSpeed engine.
    A process that has not loaded DeepSpeed holds no engine, so there the answer is no without the import."""
    try:
        from accelerate.utils import other as accelerate_other
    except ImportError:  # transformers then unwraps by itself, without the probe
        accelerate_other = None
    probe = getattr(accelerate_other, "is_deepspeed_available", None)
    if probe is not None:
        # Right for any caller, so two overlapping saves that restore out of order leave a correct probe in place
        accelerate_other.is_deepspeed_available = lambda: "deepspeed" in sys.modules and probe()
    try:
        model.save_pretrained(out, safe_serialization=True, **options)
    finally:
        if probe is not None:
            accelerate_other.is_deepspeed_available = probe

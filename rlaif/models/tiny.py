"""The demo policy: a tiny Llama-style causal LM built from a config, no download.

A byte-level BPE tokenizer is trained on the shipped demonstrations, the model is initialised from a LlamaConfig, and
a short supervised pass on the demonstrations (mixed quality on purpose, so RL has something to improve) warm-starts
it. The result is cached under $RLAIF_CACHE/models/, keyed by the config, the data and the build's code, and built
once under a file lock so concurrent processes (torchrun ranks, parallel stages) share one build.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rlaif import __version__
from rlaif.config import PolicyConfig, sha256_json
from rlaif.errors import UserError
from rlaif.io.prompts import read_demonstrations
from rlaif.io.storage import cache_dir, sha256_file
from rlaif.models.files import check_model_files, save_model

SPECIAL = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)


def _demonstration_texts(cfg: PolicyConfig) -> tuple[list[str], list[str]]:
    """The warm start's (prompts in the template, responses) that the tokenizer is trained on."""
    demos = read_demonstrations(cfg.tiny.demonstrations)
    return [cfg.prompt_template.format(prompt=d["prompt"]) for d in demos], [" " + d["response"] for d in demos]


def tiny_tokenizer(cfg: PolicyConfig):
    """The tokenizer a build of this config trains (the built policy's own), without building the model."""
    prompts, responses = _demonstration_texts(cfg)
    return _train_tokenizer(prompts + responses, cfg.tiny.vocab_size)


def _build(cfg: PolicyConfig, out: Path) -> None:
    import torch  # here, not above: the launcher's checks read the cache's paths without importing torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tiny = cfg.tiny
    torch.manual_seed(0)
    prompts, responses = _demonstration_texts(cfg)
    tokenizer = _train_tokenizer(prompts + responses, tiny.vocab_size)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=tiny.hidden_size,
            intermediate_size=tiny.intermediate_size,
            num_hidden_layers=tiny.num_layers,
            num_attention_heads=tiny.num_heads,
            num_key_value_heads=tiny.num_heads,
            max_position_embeddings=tiny.max_positions,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
        )
    )
    # Supervised warm start: next-token loss on the response tokens only.
    examples = []
    for p, r in zip(prompts, responses):
        p_ids = tokenizer(p, add_special_tokens=False).input_ids
        r_ids = tokenizer(r, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        ids = (p_ids + r_ids)[: tiny.max_positions]
        examples.append((ids, [-100] * len(p_ids) + r_ids))
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / tiny.sft_steps)))
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _step in range(tiny.sft_steps):
        batch = [examples[i] for i in torch.randint(len(examples), (tiny.sft_batch_size,), generator=gen).tolist()]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, lab) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.tensor(lab[: len(ids)])
            attention[row, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    save_model(model, out)
    tokenizer.save_pretrained(out)
    (out / "rlaif_tiny.json").write_text(
        json.dumps({"sft_final_loss": loss.item(), "config": tiny.model_dump()}, indent=2))


def build_code_digest() -> str:
    """The code a build runs: this file, the demonstrations' reader, and the release (an edit re-builds)."""
    from rlaif.io import prompts

    return sha256_json([__version__, *(sha256_file(Path(source)) for source in (__file__, prompts.__file__))])


def tiny_policy_dir(cfg: PolicyConfig) -> Path:
    """Where the tiny policy of this config is cached (built or not)."""
    read_demonstrations(cfg.tiny.demonstrations)
    key = sha256_json(
        {"tiny": cfg.tiny.model_dump(exclude={"demonstrations"}), "template": cfg.prompt_template,
         "data": sha256_file(Path(cfg.tiny.demonstrations)), "code": build_code_digest()}
    )[:16]
    return cache_dir() / "models" / f"tiny-llama-{key}"


def built(target: Path) -> bool:
    """A cached build whose files are whole (config, tokenizer and weights checked without loading them)."""
    if not (target / "config.json").exists():
        return False
    try:
        check_model_files(target, "tiny policy")
    except UserError:
        return False
    return True


def ensure_tiny_policy(cfg: PolicyConfig) -> Path:
    """Path of the cached tiny policy for this config, building it first if needed."""
    target = tiny_policy_dir(cfg)
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    if built(target):
        return target
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if built(target):
            return target
        if target.exists():  # a cached build damaged since (a truncated file): built again
            shutil.rmtree(target)
        # A build killed outright (SIGKILL, out of memory) leaves its partial folder: only this key's builder, who
        # holds the lock now, could own one, so it is debris.
        for debris in root.glob(f".{target.name}-*"):
            shutil.rmtree(debris, ignore_errors=True)
        print(f"building the tiny demo policy (once; cached at {target})", flush=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}-"))
        try:
            # In a child process: inside a torchrun rank, transformers writes weights only from global rank 0, so a
            # build on any other rank (or on another node's rank 0) would silently lack its model files.
            subprocess.run([sys.executable, "-m", "rlaif.models.tiny", cfg.model_dump_json(), str(tmp)], check=True)
            if not (tmp / "config.json").exists() or not (tmp / "model.safetensors").exists():
                raise RuntimeError(f"tiny policy build in {tmp} is incomplete")
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":  # the build step of ensure_tiny_policy: python -m rlaif.models.tiny POLICY_JSON OUT_DIR
    _build(PolicyConfig.model_validate_json(sys.argv[1]), Path(sys.argv[2]))

"""PPO iterations/s and peak memory: rlaif's PPO loop against TRL's PPOTrainer (trl==1.12.0, the last release that
has it), side by side in one run, on the same model and settings.

Same policy (the demo's tiny Llama, LoRA r16, the reference = adapter disabled in both), same reward model (a
Llama sequence classifier on the policy's tokenizer, fixed random weights: throughput does not depend on them; both
score the sampled token ids, ours through the stage's scorer), same
prompts, rollout batch 64, minibatch 16, 2 PPO epochs, responses up to 48 tokens, one process each with the same
threads. TRL adds its own critic (a second Llama with a score head, as its PPOTrainer requires); rlaif puts a value
head on the policy's backbone. Each trainer runs in its own process, so its peak memory (RSS on CPUs, allocated GPU
memory on GPUs) is its own. On a GPU both run bf16 autocast. Medians over --trials.

    .venv-bench-ppo/bin/python bench/bench_ppo.py --trials 3 --iterations 6 [--size h512x8] [--lora-rank 0]
        [--fixed-length] [--rollout 64 --minibatch 16 --epochs 2 --response-length 48]

--lora-rank 0 trains all weights (the reference is a frozen copy in both); --fixed-length makes every response
max_new_tokens long in both (no stop at EOS), so both sample the same number of tokens whatever the policy.
Memory: each worker's peak RSS (VmHWM), and its peak above the RSS it had once its imports were done (the trainers
import different libraries). Each worker imports the libraries its trainer uses before that baseline: TRL's import
brings transformers' model classes, peft, accelerate and datasets; ours imports transformers' model classes, and peft
when LoRA is on (the stage imports both lazily).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import compare_iterations, mark_import_baseline, report_result  # noqa: E402

from rlaif.distributed import clock  # noqa: E402

ROLLOUT, MINIBATCH, EPOCHS, RESPONSE_LEN, LR = 64, 16, 2, 48, 1e-3
COMMON = [f"ppo.lr={LR}", "ppo.checkpoint_every=0",
          "ppo.temperature=1.0"]  # both trainers sample at 1.0 (TRL's worker passes temperature=1.0)


def shape_overrides(rollout: int, minibatch: int, epochs: int, response_length: int) -> list[str]:
    """The config overrides of one batch shape (TRL: per_device_train_batch_size, rollout / num_mini_batches,
    num_ppo_epochs, response_length)."""
    return [f"ppo.rollout_batch_size={rollout}", f"ppo.minibatch_size={minibatch}", f"ppo.ppo_epochs={epochs}",
            f"ppo.max_new_tokens={response_length}"]


KL_COEF = 0.05  # both trainers' KL weight unless --kl-coef says otherwise
OVERRIDES = [*shape_overrides(ROLLOUT, MINIBATCH, EPOCHS, RESPONSE_LEN), *COMMON]  # the usual shape


def bench_overrides(a) -> list[str]:
    """The run's batch shape, LoRA rank and response-length mode, and the settings every bench shares."""
    return [*shape_overrides(a.rollout, a.minibatch, a.epochs, a.response_length), *COMMON,
            f"ppo.lora_rank={a.lora_rank}", f"ppo.fixed_length={str(a.fixed_length).lower()}",
            f"ppo.rollout_logprobs={a.rollout_logprobs}", f"ppo.reward_inputs={a.reward_inputs}",
            f"ppo.kl_coef={a.kl_coef}"]


def import_our_libraries(a) -> None:
    """What rlaif's stage imports when it builds the policy, before the import baseline, as TRL's worker has imported
    them with trl: transformers' model classes (~120 MiB of RSS; `import transformers` alone loads them lazily) and
    peft for LoRA. Neither worker has imported the Llama module itself at its baseline."""
    import transformers.modeling_utils  # noqa: F401

    import rlaif.models.policy  # noqa: F401
    import rlaif.stages.ppo  # noqa: F401

    if a.lora_rank:
        import peft  # noqa: F401


def trl_peft_config(a):
    from peft import LoraConfig

    from rlaif.models.policy import LORA_TARGETS

    return (LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
            if a.lora_rank else None)


SIZES = {"demo": None, "h128x2": (128, 2, 4, 384), "h256x4": (256, 4, 4, 768), "h512x8": (512, 8, 8, 1536),
         "h256x4v32k": (256, 4, 4, 768, 32000), "h1024x16": (1024, 16, 16, 2816), "h2048x16": (2048, 16, 16, 5632)}
# hidden, layers, heads, intermediate[, vocabulary] (random weights; h128x2 is the demo's shape); the larger two are
# for GPUs. h256x4v32k has a Llama tokenizer's 32k-token output layer on the demo tokenizer: the prompts use its ids,
# sampled ids beyond them are never decoded (both trainers score token ids), so it measures a large vocabulary's cost.


def shared_models(work: Path, size: str) -> tuple[Path, Path]:
    """The policy's directory (the demo's tiny Llama, or a larger random one on its tokenizer) and a reward model
    on the same tokenizer, saved once for both workers."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from rlaif.config import load_config
    from rlaif.models.loading import load_tokenizer, resolve_policy

    policy_dir = resolve_policy(load_config("configs/demo.yaml").policy)
    if SIZES[size] is not None:
        hidden, layers, heads, inter, *vocab = SIZES[size]
        big = work / f"bench-ppo-policy-{size}"
        if not (big / "config.json").exists():
            config = AutoConfig.from_pretrained(str(policy_dir))
            config.hidden_size, config.num_hidden_layers, config.num_attention_heads = hidden, layers, heads
            config.num_key_value_heads, config.intermediate_size, config.head_dim = heads, inter, hidden // heads
            config.vocab_size = vocab[0] if vocab else config.vocab_size
            torch.manual_seed(0)
            LlamaForCausalLM(config).save_pretrained(big, safe_serialization=True)
            load_tokenizer(policy_dir).save_pretrained(big)
        policy_dir = big
    rm_dir = work / f"bench-ppo-rm-{size}"
    if not (rm_dir / "config.json").exists():
        config = AutoConfig.from_pretrained(str(policy_dir))
        config.num_labels = 1
        torch.manual_seed(0)
        LlamaForSequenceClassification(config).save_pretrained(rm_dir, safe_serialization=True)
        load_tokenizer(policy_dir).save_pretrained(rm_dir)
    if not (rm_dir / "reward_stats.json").exists():  # as train_rm exports it, so ours scores through the stage's scorer
        (rm_dir / "reward_stats.json").write_text(json.dumps({"mean": 0.0, "std": 1.0, "max_length": 4096}))
    return policy_dir, rm_dir


def prompts(n: int) -> list[str]:
    from rlaif.config import load_config
    from rlaif.io.prompts import split

    cfg = load_config("configs/demo.yaml")
    return [cfg.policy.prompt_template.format(prompt=p["prompt"]) for p in split(cfg.data, "train")[:n]]


def ours_setup(overrides: list[str], rm_dir: Path):
    """rlaif's side of a PPO/GRPO bench: the config, the stage's policy, reference, reward scorer (on the policy's
    token ids, as the stage scores with a reward model on the policy's tokenizer) and engine."""
    from rlaif import distributed as dist
    from rlaif.config import load_config
    from rlaif.models.policy import build_policy
    from rlaif.models.reward import reward_scorer
    from rlaif.stages import ppo

    cfg = load_config("configs/demo.yaml", overrides)
    dist.avoid_per_shape_attention_plans()  # as run_stage does for every stage
    _, _, device = dist.setup()
    tokenizer, policy, reference_logprobs = build_policy(cfg, device)
    reward_fn = reward_scorer(rm_dir, cfg.ppo.reward_inputs, tokenizer, device)
    amp = ppo.autocast(device.type == "cuda")  # bf16 on GPUs, as the stage does (and as TRL's bf16=True does)
    engine = ppo.make_engine(cfg, policy, device)
    return cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp


def worker_ours(a) -> dict:
    from rlaif.io.prompts import split  # noqa: F401 (imported before the memory baseline, as before: run_ours uses it)
    from rlaif.stages import ppo  # noqa: F401

    import_our_libraries(a)
    mark_import_baseline()
    policy_dir, rm_dir = shared_models(Path(a.work), a.size)
    setup = ours_setup([*bench_overrides(a), f"policy.model={policy_dir}"], rm_dir)  # demo + OVERRIDES: DDP, const LR
    return run_ours(setup, a.iterations)


def run_ours(setup: tuple, iterations: int) -> dict:
    """Our side's timed loop, the stage's rollout and update as its iteration runs them, with the config's batch and
    KL weight: iterations/s, samples/s and each phase's peak RSS in the first iteration (rlaif/phases.py)."""
    from rlaif.io.prompts import split
    from rlaif.phases import RL_PHASES, phase
    from rlaif.stages import ppo

    cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp = setup
    rows, peaks, kl_coef = split(cfg.data, "train"), {}, cfg.ppo.kl_coef
    per_iteration = ppo.prompts_per_iteration(cfg.ppo)
    start = clock()
    for it in range(iterations):
        chunk = [rows[(it * per_iteration + k) % len(rows)] for k in range(per_iteration)]
        batch, _, timings = ppo.rollout(cfg, policy, reference_logprobs, tokenizer, reward_fn, chunk, seed=it,
                                        device=device, kl_coef=kl_coef, amp=amp)
        with phase("update", timings):
            ppo.update(cfg, engine, ppo.whiten_advantages(cfg, batch), seed=it, kl_coef=kl_coef, amp=amp)
        if it == 0:  # later iterations start from the memory glibc kept from the first one's frees
            peaks = {name: timings[f"{name}_rss_mib"] for name in RL_PHASES if f"{name}_rss_mib" in timings}
    seconds = clock() - start
    return {"iterations_per_s": iterations / seconds,
            "samples_per_s": iterations * cfg.ppo.rollout_batch_size / seconds, "phase_rss_mib": peaks}


def worker_trl(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from rlaif.distributed import avoid_per_shape_attention_plans
    from rlaif.models.loading import load_tokenizer

    mark_import_baseline()
    work, iterations, size = Path(a.work), a.iterations, a.size
    avoid_per_shape_attention_plans()  # the same attention backends as ours (ours_setup), a PyTorch setting
    policy_dir, rm_dir = shared_models(work, size)
    tok = load_tokenizer(policy_dir, padding_side="left")
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts(a.rollout * iterations)]
    torch.manual_seed(0)
    args = PPOConfig(output_dir=str(work / "trl-ppo-out"), per_device_train_batch_size=a.rollout,
                     gradient_accumulation_steps=1, num_mini_batches=a.rollout // a.minibatch, num_ppo_epochs=a.epochs,
                     local_rollout_forward_batch_size=a.rollout, total_episodes=a.rollout * iterations,
                     response_length=a.response_length, learning_rate=LR,
                     stop_token=None if a.fixed_length else "eos",  # None: no EOS in generate (fixed length)
                     num_sample_generations=0, report_to=[], save_strategy="no", logging_steps=10**6,
                     use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), fp16=False,
                     dataloader_num_workers=0, disable_tqdm=True, kl_coef=a.kl_coef, vf_coef=0.1,
                     lam=0.95, gamma=1.0, temperature=1.0,
                     gradient_checkpointing=False)  # TRL's config default is on; rlaif does not recompute activations
    trainer = PPOTrainer(
        args=args, processing_class=tok, model=AutoModelForCausalLM.from_pretrained(str(policy_dir)), ref_model=None,
        reward_model=AutoModelForSequenceClassification.from_pretrained(str(rm_dir)),
        value_model=AutoModelForSequenceClassification.from_pretrained(str(rm_dir)),
        train_dataset=Dataset.from_dict({"input_ids": ids}),
        peft_config=trl_peft_config(a),
    )
    start = clock()
    trainer.train()
    seconds = clock() - start
    return {"iterations_per_s": iterations / seconds, "samples_per_s": iterations * a.rollout / seconds}


def cli(script: str, workers: dict, algorithm: str, ours: str, peer: str, algorithm_overrides=()) -> None:
    """The command line shared by bench_ppo and bench_grpo (`algorithm_overrides`: GRPO's settings): a worker run, or
    the side-by-side comparison. The stage's config checks the batch shape for both trainers, before either runs."""

    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--worker", choices=list(workers))
    p.add_argument("--work", default="runs")
    p.add_argument("--size", choices=list(SIZES), default="demo", help="policy size (h512x8: 28M parameters)")
    p.add_argument("--lora-rank", type=int, default=16, help="0: all weights trained")
    p.add_argument("--rollout", type=int, default=ROLLOUT, help="samples per iteration")
    p.add_argument("--minibatch", type=int, default=MINIBATCH, help="samples per optimizer step")
    p.add_argument("--epochs", type=int, default=EPOCHS, help="passes over each rollout (PPO epochs, GRPO iterations)")
    p.add_argument("--response-length", type=int, default=RESPONSE_LEN, help="tokens per response at most")
    p.add_argument("--fixed-length", action="store_true", help="every response max_new_tokens long (no EOS stop)")
    p.add_argument("--rollout-logprobs", choices=["auto", "sampled", "recompute"], default="auto",
                   help="ours: ppo.rollout_logprobs (old log-probs and values from the sampler, or recomputed)")
    p.add_argument("--reward-inputs", choices=["auto", "text"], default="auto",
                   help="ours: ppo.reward_inputs (the sampled token ids, or decoded and re-tokenized text)")
    p.add_argument("--kl-coef", type=float, default=KL_COEF,
                   help="KL weight in both (TRL GRPOConfig's beta, whose default 0 runs no reference model)")
    a = p.parse_args()
    if a.worker:  # spawned by the comparison below, which has checked the shape
        report_result(workers[a.worker](a))
        return
    from rlaif.config import load_config
    from rlaif.errors import UserError

    try:  # checked here, not in the workers, whose imports before their memory baseline stay as they were
        load_config("configs/demo.yaml", [*bench_overrides(a), *algorithm_overrides])
    except UserError as error:  # TRL would floor a shape that does not divide and compare a different workload
        p.error(str(error))
    import trl

    passed = ["--rollout", str(a.rollout), "--minibatch", str(a.minibatch), "--epochs", str(a.epochs),
              "--response-length", str(a.response_length), "--lora-rank", str(a.lora_rank),
              "--rollout-logprobs", a.rollout_logprobs,
              "--reward-inputs", a.reward_inputs, "--kl-coef", str(a.kl_coef),
              *(["--fixed-length"] if a.fixed_length else [])]
    setting = f"LoRA r{a.lora_rank}" if a.lora_rank else "all weights"
    if (a.rollout, a.minibatch, a.epochs, a.response_length) != (ROLLOUT, MINIBATCH, EPOCHS, RESPONSE_LEN):
        setting += f", rollout {a.rollout}, minibatch {a.minibatch}, {a.epochs} epochs, {a.response_length} tokens"
    if a.kl_coef != KL_COEF:
        setting += f", KL weight {a.kl_coef:g}"
    compare_iterations(script, a, lambda: shared_models(Path(a.work), a.size),
                       f"{algorithm} iteration vs {peer} (policy {a.size}, {setting}"
                       f"{', fixed-length responses' if a.fixed_length else ''}"
                       f"{'' if a.rollout_logprobs == 'auto' else ', rollout log-probs ' + a.rollout_logprobs}"
                       f"{'' if a.reward_inputs == 'auto' else ', rewards on ' + a.reward_inputs}"
                       f"; trl {trl.__version__}; median of "
                       f"{a.trials} trials of {a.iterations} iterations)", ours, peer, passed)


def main() -> None:
    cli(__file__, {"ours": worker_ours, "trl": worker_trl}, "PPO", "rlaif ppo", "TRL PPOTrainer")


if __name__ == "__main__":
    main()

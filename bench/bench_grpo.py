"""GRPO iterations/s and peak memory: rlaif's GRPO (ppo.algorithm=grpo) against TRL's GRPOTrainer, side by side in
one run, on the same model and settings (bench_ppo.py's models: the demo's tiny Llama with LoRA r16, the reference =
adapter disabled, a fixed random Llama reward model on the same tokenizer).

Per iteration by default: 16 prompts x 4 samples = 64 completions of up to 48 tokens, minibatches of 16, 2 passes
(TRL: num_iterations=2, steps_per_generation=4; --rollout, --minibatch, --epochs and --response-length change them),
KL weight 0.05 as a loss term (k3 in both; --kl-coef 0 is TRL's default, and then neither runs a reference), loss
normalised per sequence (TRL loss_type="grpo"), group-std-scaled advantages (both). One process each with the same
threads; medians over --trials. TRL runs from .venv-bench (trl 1.16; 1.12's GRPOTrainer needs packages its
environment lacks).

    .venv-bench/bin/python bench/bench_grpo.py --trials 3 --iterations 6 [--size h512x8] [--lora-rank 0]
        [--fixed-length] [--rollout 64 --minibatch 16 --epochs 2 --response-length 48] [--kl-coef 0.05]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_ppo import (  # noqa: E402
    LR,
    bench_overrides,
    cli,
    import_our_libraries,
    ours_setup,
    prompts,
    run_ours,
    shared_models,
    trl_peft_config,
)
from common import mark_import_baseline  # noqa: E402

from rlaif.distributed import clock  # noqa: E402

GROUP = 4
KL = 0.05
GRPO_OVERRIDES = ["ppo.algorithm=grpo", f"ppo.group_size={GROUP}", "ppo.kl_estimator=k3", f"ppo.kl_coef={KL}"]


def worker_ours(a) -> dict:
    from rlaif.io.prompts import split  # noqa: F401 (imported before the memory baseline, as before: run_ours uses it)
    from rlaif.stages import ppo  # noqa: F401

    import_our_libraries(a)
    mark_import_baseline()
    policy_dir, rm_dir = shared_models(Path(a.work), a.size)
    setup = ours_setup([*GRPO_OVERRIDES, *bench_overrides(a), f"policy.model={policy_dir}"], rm_dir)  # KL last
    return run_ours(setup, a.iterations)


def worker_trl(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl import GRPOConfig, GRPOTrainer

    from rlaif.distributed import avoid_per_shape_attention_plans
    from rlaif.models.loading import load_tokenizer

    mark_import_baseline()
    work, iterations, size = Path(a.work), a.iterations, a.size
    avoid_per_shape_attention_plans()  # the same attention backends as ours (ours_setup), a PyTorch setting
    policy_dir, rm_dir = shared_models(work, size)
    tok = load_tokenizer(policy_dir, padding_side="left")
    rm_tok = load_tokenizer(rm_dir, padding_side="right")
    steps_per_generation = a.rollout // a.minibatch
    torch.manual_seed(0)
    args = GRPOConfig(output_dir=str(work / "trl-grpo-out"), per_device_train_batch_size=a.minibatch,
                      steps_per_generation=steps_per_generation, num_generations=GROUP, num_iterations=a.epochs,
                      max_completion_length=a.response_length, beta=a.kl_coef, loss_type="grpo", learning_rate=LR,
                      temperature=1.0,
                      max_steps=iterations * steps_per_generation * a.epochs, gradient_accumulation_steps=1,
                      report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True,
                      dataloader_num_workers=0,
                      bf16=torch.cuda.is_available(), fp16=False, use_cpu=not torch.cuda.is_available(),
                      generation_kwargs={"min_new_tokens": a.response_length} if a.fixed_length else None,
                      gradient_checkpointing=False)  # TRL's default recomputes activations; rlaif does not
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(policy_dir)), args=args, processing_class=tok,
        reward_funcs=AutoModelForSequenceClassification.from_pretrained(str(rm_dir)), reward_processing_classes=rm_tok,
        train_dataset=Dataset.from_dict({"prompt": prompts(a.rollout * iterations)}),
        peft_config=trl_peft_config(a),
    )
    start = clock()
    trainer.train()
    seconds = clock() - start
    return {"iterations_per_s": iterations / seconds, "samples_per_s": iterations * a.rollout / seconds}


def main() -> None:
    cli(__file__, {"ours": worker_ours, "trl": worker_trl}, "GRPO", "rlaif grpo", "TRL GRPOTrainer",
        GRPO_OVERRIDES)


if __name__ == "__main__":
    main()

"""Run under torchrun by test_ppo.py: one update on a fixed synthetic global batch, each rank holding its slice of it
(as after a distributed rollout): PPO and GRPO under DDP and PPO under DeepSpeed ZeRO-2, each without and with
gradient accumulation, PPO under ZeRO-3, and PPO with all weights trained under DDP and ZeRO-3 (a fresh policy for
each, so one launch serves all nine); rank 0 saves the trainable weights as OUT_DIR/{ppo,grpo,zero2}-accum{1,2}.pt,
OUT_DIR/zero3-accum1.pt and OUT_DIR/{ddp,deepspeed}-all-weights.pt.

    torchrun --nproc_per_node=N tests/stages/ppo_update_worker.py OUT_DIR
"""
import contextlib
import sys

import torch

from rlaif import distributed as dist
from rlaif.config import load_config
from rlaif.models.policy import build_policy
from rlaif.stages import ppo


def synthetic_batch(cfg, policy, reference_logprobs, vocab: int, rows: int = 8, prompt_len: int = 6) -> dict:
    g = torch.Generator().manual_seed(123)
    width = cfg.ppo.max_new_tokens
    prompt_ids = torch.randint(3, vocab, (rows, prompt_len), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    for r in range(rows):  # left padding of varying length
        prompt_mask[r, : r % 3] = 0
    responses = torch.randint(3, vocab, (rows, width), generator=g)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        old_logprobs, _, values = policy(prompt_ids, prompt_mask, responses, mask)
        ref_logprobs = reference_logprobs(policy, prompt_ids, prompt_mask, responses, mask)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, responses=responses, mask=mask,
                old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, old_values=values.float(),
                advantages=torch.randn(rows, width, generator=g) * mask,
                returns=torch.randn(rows, width, generator=g) * mask)


def one_update(out: str, overrides: list[str], rank: int, world: int, device) -> None:
    cfg = load_config("configs/tiny.yaml", ["ppo.rollout_batch_size=8", "ppo.minibatch_size=4", "ppo.ppo_epochs=2",
                                            *overrides])
    tokenizer, policy, reference_logprobs = build_policy(cfg, device)
    batch = synthetic_batch(cfg, policy, reference_logprobs, len(tokenizer))
    local = batch["responses"].shape[0] // world
    mine = {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}
    gathered = ppo.gather_batch(mine, tokenizer.pad_token_id)
    assert all(torch.equal(gathered[k], batch[k]) for k in batch), "gather must rebuild the global batch"
    engine = ppo.make_engine(cfg, policy, device)
    ppo.update(cfg, engine, gathered, seed=7, kl_coef=cfg.ppo.kl_coef, amp=contextlib.nullcontext)
    with engine.full_parameters():  # ZeRO-3: the partitions gathered, as the stage's export gathers them
        if rank == 0:
            torch.save({n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}, out)


def main(out_dir: str) -> None:
    rank, world, device = dist.setup()
    for algorithm in ("ppo", "grpo"):
        for accum in (1, 2):
            one_update(f"{out_dir}/{algorithm}-accum{accum}.pt",
                       [f"ppo.algorithm={algorithm}", "ppo.group_size=2", f"ppo.grad_accum_steps={accum}"], rank, world,
                       device)
    for stage, accum in ((2, 1), (2, 2), (3, 1)):  # DeepSpeed counts micro-batches itself: accumulation once failed
        one_update(f"{out_dir}/zero{stage}-accum{accum}.pt", ["ppo.strategy=deepspeed", f"ppo.zero_stage={stage}",
                                                              f"ppo.grad_accum_steps={accum}"], rank, world, device)
    for strategy in ("ddp", "deepspeed"):  # all weights: ZeRO-3 partitions the policy, not its frozen reference copy
        one_update(f"{out_dir}/{strategy}-all-weights.pt", [f"ppo.strategy={strategy}", "ppo.zero_stage=3",
                                                             "ppo.lora_rank=0"], rank, world, device)
    dist.teardown()


if __name__ == "__main__":
    main(sys.argv[1])

"""Run under torchrun by test_ppo.py: one PPO/GRPO update on a fixed synthetic global batch, each rank holding its
slice of it (as after a distributed rollout), then the trainable weights saved by rank 0.

    torchrun --nproc_per_node=N tests/stages/ppo_update_worker.py OUT.pt [KEY=VALUE ...]
"""
import contextlib
import sys

import torch

from rlaif import distributed as dist
from rlaif.config import load_config
from rlaif.stages import ppo
from rlaif.models.generation import token_logprobs


def synthetic_batch(cfg, policy, reference_logits, vocab: int, rows: int = 8, prompt_len: int = 6) -> dict:
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
        logits, values = policy(prompt_ids, prompt_mask, responses, mask)
        old_logprobs = token_logprobs(logits, responses, cfg.ppo.temperature)
        ref_logprobs = token_logprobs(reference_logits(policy, prompt_ids, prompt_mask, responses, mask), responses, cfg.ppo.temperature)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, responses=responses, mask=mask, old_logprobs=old_logprobs,
                ref_logprobs=ref_logprobs, old_values=values.float(), advantages=torch.randn(rows, width, generator=g) * mask,
                returns=torch.randn(rows, width, generator=g) * mask)


def main(out: str, overrides: list[str]) -> None:
    cfg = load_config("configs/tiny.yaml", ["ppo.rollout_batch_size=8", "ppo.minibatch_size=4", "ppo.ppo_epochs=2", *overrides])
    rank, world, device = dist.setup()
    tokenizer, policy, reference_logits = ppo.build_policy(cfg, device)
    batch = synthetic_batch(cfg, policy, reference_logits, len(tokenizer))
    local = batch["responses"].shape[0] // world
    mine = {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()}
    gathered = ppo.gather_batch(mine, tokenizer.pad_token_id)
    assert all(torch.equal(gathered[k], batch[k]) for k in batch), "gather must rebuild the global batch"
    engine = ppo.make_engine(cfg, policy, device)
    ppo.update(cfg, engine, gathered, seed=7, kl_coef=cfg.ppo.kl_coef, amp=contextlib.nullcontext)
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}, out)
    dist.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

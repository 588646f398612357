"""rlaif.algo.batches: a micro-batch keeps only the columns its own rows use (prompts are left-padded, responses
right-padded), and a policy's log-probs on the trimmed micro-batch equal those on the padded one."""
import pytest
import torch

from rlaif.algo.batches import minibatch_order, pad_left, pad_right, trimmed


def batch_of(prompt_lengths, response_lengths, prompt_width=6, response_width=5):
    prompt_mask = torch.stack([pad_left(torch.ones(1, n, dtype=torch.long), prompt_width, 0)[0]
                               for n in prompt_lengths])
    mask = torch.stack([pad_right(torch.ones(1, n, dtype=torch.long), response_width, 0)[0] for n in response_lengths])
    prompt_ids = prompt_mask * torch.arange(1, prompt_width + 1)
    responses = mask * torch.arange(10, 10 + response_width)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "responses": responses, "mask": mask,
            "advantages": mask.float()}


def test_trimmed_drops_exactly_the_columns_that_are_padding_in_every_picked_row():
    batch = batch_of([2, 4, 1], [3, 1, 5])
    both = trimmed(batch, torch.tensor([0, 2]))  # longest prompt 2, longest response 5
    assert both["prompt_ids"].shape == (2, 2) and both["responses"].shape == (2, 5)
    assert both["advantages"].shape == (2, 5)
    first = trimmed(batch, torch.tensor([0, 1]))  # longest prompt 4, longest response 3
    assert first["prompt_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert first["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert torch.equal(trimmed(batch)["prompt_ids"], batch["prompt_ids"][:, 2:])  # every row: only row 2's padding
    empty = trimmed(batch_of([2], [0]))  # no response tokens at all: one column kept, shapes stay valid
    assert empty["responses"].shape == (1, 1)


def test_a_policy_sees_the_same_log_probs_on_the_trimmed_micro_batch():
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlaif.models.generation import response_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         pad_token_id=0)).eval()
    batch = batch_of([2, 4, 5], [3, 1, 4], prompt_width=8, response_width=7)
    picked = torch.tensor([0, 1])
    full = {k: v[picked] for k, v in batch.items()}
    part = trimmed(batch, picked)
    with torch.no_grad():
        padded, _, _ = response_logprobs(model, full["prompt_ids"], full["prompt_mask"], full["responses"],
                                         full["mask"])
        cut, _, _ = response_logprobs(model, part["prompt_ids"], part["prompt_mask"], part["responses"], part["mask"])
    width = cut.shape[1]
    torch.testing.assert_close(cut * part["mask"], padded[:, :width] * full["mask"][:, :width], atol=1e-5, rtol=1e-5)
    assert (full["mask"][:, width:] == 0).all()


def test_minibatch_order_keeps_each_group_together_and_is_randperm_for_single_rows():
    order = minibatch_order(24, 4, seed=7)
    assert sorted(order.tolist()) == list(range(24))
    groups = order.view(6, 4)
    assert torch.equal(groups - groups[:, :1], torch.arange(4).expand(6, 4))  # 4 adjacent rows, in order
    assert (groups[:, 0] % 4 == 0).all() and groups[:, 0].tolist() != sorted(groups[:, 0].tolist())
    assert torch.equal(minibatch_order(24, 4, seed=7), order)
    assert torch.equal(minibatch_order(24, 1, seed=7), torch.randperm(24, generator=torch.Generator().manual_seed(7)))
    with pytest.raises(ValueError, match="not whole groups"):
        minibatch_order(10, 4, seed=0)

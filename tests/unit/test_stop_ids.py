"""A model whose generation config lists end ids beyond its tokenizer's EOS (an instruct model's end of turn: Gemma's
<end_of_turn>, Llama 3's <|eot_id|>): every sampler (the static decoder, transformers' generate, the seeded sampler
the model service uses) stops at any of them, and the response mask ends there, as transformers' own generate() does
with the model's generation config."""
import json
import shutil

import pytest
import torch

from rlaif.models.generation import (
    encode_prompts,
    is_stop,
    response_mask,
    sample,
    sample_seeded,
    stop_ids,
)
from rlaif.models.loading import load_causal_lm, policy_tokenizer

PROMPTS = ["How do I keep basil alive?", "Fix a squeaky door", "What is a good first houseplant?"]


@pytest.fixture(scope="module")
def end_of_turn_policy(tmp_path_factory):
    """The tiny policy, with a second end id in its generation config: the token it samples first, greedily, for
    the first prompt (so that prompt's response must end after one token)."""
    from rlaif.config import load_config
    from rlaif.models.loading import resolve_policy

    policy = load_config("configs/tiny.yaml").policy
    path = shutil.copytree(resolve_policy(policy), tmp_path_factory.mktemp("eot") / "policy")
    tokenizer, model = policy_tokenizer(path, policy), load_causal_lm(path).eval()
    enc = encode_prompts(tokenizer, PROMPTS[:1], "cpu")
    first = int(sample(model, tokenizer, enc, max_new_tokens=1, temperature=0)[0, 0])
    assert first != tokenizer.eos_token_id
    settings = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": [tokenizer.eos_token_id,
                                                                                          first]}))
    return path, policy, first


def test_the_tokenizer_holds_every_end_id(end_of_turn_policy):
    path, policy, end_of_turn = end_of_turn_policy
    tokenizer = policy_tokenizer(path, policy)
    assert stop_ids(tokenizer) == [tokenizer.eos_token_id, end_of_turn]
    rows = torch.tensor([[5, end_of_turn, 6, 7], [5, 6, tokenizer.eos_token_id, 8], [5, 6, 7, 8]])
    assert response_mask(rows, stop_ids(tokenizer)).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert response_mask(rows, tokenizer.eos_token_id).tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert is_stop(rows, stop_ids(tokenizer)).sum().item() == 2


@pytest.mark.parametrize("decoder", ["static", "generate"])
def test_every_sampler_stops_at_the_models_end_of_turn(end_of_turn_policy, decoder):
    path, policy, end_of_turn = end_of_turn_policy
    tokenizer, model = policy_tokenizer(path, policy), load_causal_lm(path).eval()
    enc = encode_prompts(tokenizer, PROMPTS, "cpu")
    greedy = sample(model, tokenizer, enc, max_new_tokens=12, temperature=0, decoder=decoder)
    assert greedy[0, 0] == end_of_turn and response_mask(greedy, stop_ids(tokenizer))[0].sum() == 1
    assert (greedy[0, 1:] == tokenizer.pad_token_id).all()  # padded after the row's end, as after an EOS
    seeded = sample_seeded(model, tokenizer, enc, [1, 2, 3], max_new_tokens=12, temperature=0, decoder=decoder)
    assert seeded[0, 0] == end_of_turn and (seeded[0, 1:] == tokenizer.pad_token_id).all()
    fixed = sample(model, tokenizer, enc, max_new_tokens=6, temperature=0, min_new_tokens=6, decoder=decoder)
    assert fixed.shape[1] == 6 and not is_stop(fixed, stop_ids(tokenizer)).any()  # no end id before min_new_tokens


def test_the_graph_cache_keys_a_decode_with_several_end_ids(end_of_turn_policy, monkeypatch):
    """The captured-graph path keeps each graph under its settings, the end ids among them: a list there was
    unhashable and failed every GPU decode. The capture itself is stood in for (no GPU here) by its two eager steps."""
    from rlaif.models import decode

    path, policy, end_of_turn = end_of_turn_policy
    tokenizer, model = policy_tokenizer(path, policy), load_causal_lm(path).eval()

    def eager_capture(state):
        state.step()
        state.step()
        return state.step

    monkeypatch.setattr(decode, "capture", eager_capture)
    monkeypatch.setattr(decode, "CAPTURED", decode.CapturedGraphs(2))
    enc = encode_prompts(tokenizer, PROMPTS, "cpu")
    kwargs = dict(max_new_tokens=8, temperature=0, eos_ids=stop_ids(tokenizer), pad_id=tokenizer.pad_token_id,
                  cuda_graph=True)
    first = decode.decode_static(model, enc, [1, 2, 3], **kwargs)
    again = decode.decode_static(model, enc, [1, 2, 3], **kwargs)  # the kept "graph", found by its settings
    assert first[0, 0] == end_of_turn and torch.equal(first, again)

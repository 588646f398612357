"""Scoring rollouts on the policy's token ids (ppo.reward_inputs): the reward model's pair template built around
the response ids is exactly what its tokenizer makes of the text pair (special tokens, token types, longest-first
truncation, padding side), for a decoder tokenizer (the built-in tiny policy's, built in seconds where the demo's
takes a minute and a half) and an encoder one (MiniLM's); scores match the text path; tokenizers that differ are told
apart, and token_ids with a different tokenizer is refused."""
import json

import pytest
import torch

from rlaif.errors import UserError
from rlaif.models.reward import NormalisedScorer, longest_first, pair_inputs, reward_scorer

PROMPTS = ["How do I keep basil alive on a windowsill?", "Fix a squeaky door", ""]
RESPONSES = ["Water it when the top of the soil is dry.", "Oil the hinge, then open and close it a few times.",
             "Start small."]


@pytest.fixture(scope="module")
def policy_dir():
    from rlaif.config import load_config
    from rlaif.models.loading import resolve_policy

    return resolve_policy(load_config("configs/tiny.yaml").policy)


@pytest.fixture(scope="module")
def minilm_tokenizer():
    from transformers import AutoTokenizer

    from rlaif.models.loading import minilm_dir

    return AutoTokenizer.from_pretrained(str(minilm_dir()))


@pytest.fixture(scope="module")
def policy_tokenizer(policy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(policy_dir))


@pytest.mark.parametrize("which", ["policy", "minilm"])
@pytest.mark.parametrize("max_length", [512, 16, 9])
@pytest.mark.parametrize("side", ["right", "left"])
def test_pair_inputs_equal_the_tokenizers_text_pairs(which, max_length, side, request):
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    tokenizer.padding_side = side
    response_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    ours = pair_inputs(tokenizer, PROMPTS, response_ids, max_length)
    theirs = tokenizer(PROMPTS, RESPONSES, padding=True, truncation=True, max_length=max_length,
                       return_tensors="pt")
    assert set(ours) == {k for k in theirs if k in ("input_ids", "attention_mask", "token_type_ids")}
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


def test_longest_first_keeps_what_the_tokenizers_library_keeps():
    # tokenizers' own table (src/utils/truncation.rs, max_length 7; lengths 0, 2, 4 and 8), plus budgets below zero.
    lengths = (0, 2, 4, 8)
    kept = {(0, 8): (0, 7), (2, 8): (2, 5), (4, 4): (3, 4), (4, 8): (3, 4), (8, 0): (7, 0), (8, 2): (5, 2),
            (8, 4): (4, 3), (8, 8): (3, 4)}
    for first in lengths:
        for second in lengths:
            assert longest_first(first, second, 7) == kept.get((first, second), (first, second)), (first, second)
    assert longest_first(5, 3, -2) == (0, 0)


def reward_model_on(tokenizer_dir, out):
    """A tiny random Llama sequence classifier on the policy's tokenizer, exported as train_rm exports one."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(str(tokenizer_dir))
    config.num_labels = 1
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out)
    (out / "reward_stats.json").write_text(json.dumps({"mean": 0.5, "std": 2.0, "max_length": 512}))
    return out


def test_scores_on_token_ids_equal_scores_on_text(policy_dir, policy_tokenizer, minilm_tokenizer, tmp_path):
    scorer = NormalisedScorer(reward_model_on(policy_dir, tmp_path / "rm"), torch.device("cpu"))
    assert scorer.shares_tokenizer(policy_tokenizer) and not scorer.shares_tokenizer(minilm_tokenizer)
    ids = [policy_tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    width = max(map(len, ids)) + 3
    eos, pad = policy_tokenizer.eos_token_id, policy_tokenizer.pad_token_id
    # Right-padded responses as the sampler returns them: EOS after the text (dropped, as decoding drops it), then
    # padding that the mask leaves out.
    responses = torch.tensor([row + [eos] + [pad] * (width - len(row) - 1) for row in ids])
    mask = torch.tensor([[1] * (len(row) + 1) + [0] * (width - len(row) - 1) for row in ids])
    on_ids = scorer.score_tokens(PROMPTS, responses, mask, batch_size=2)
    on_text = scorer(PROMPTS, RESPONSES)
    assert on_ids.shape == (3,) and torch.allclose(on_ids, on_text, atol=1e-5)
    assert not torch.allclose(on_ids, torch.zeros(3))


def test_token_ids_with_another_tokenizer_is_refused(policy_dir, policy_tokenizer, minilm_tokenizer, tmp_path):
    path = reward_model_on(policy_dir, tmp_path / "rm")
    assert reward_scorer(path, "auto", policy_tokenizer, "cpu").token_ids
    assert not reward_scorer(path, "text", policy_tokenizer, "cpu").token_ids
    assert not reward_scorer(path, "auto", minilm_tokenizer, "cpu").token_ids
    with pytest.raises(UserError, match="ppo.reward_inputs=token_ids needs the reward model's tokenizer"):
        reward_scorer(path, "token_ids", minilm_tokenizer, "cpu")


def test_token_ids_with_another_backbone_tokenizer_is_refused_at_launch(policy_dir):
    """Before any work, not after train_rm: the reward model keeps its backbone's tokenizer. The built-in policy's is
    trained from its demonstrations where the policy is not built yet (policy None)."""
    from rlaif.config import load_config
    from rlaif.models.loading import minilm_dir
    from rlaif.orchestration.preflight import check_reward_inputs

    cfg = load_config("configs/tiny.yaml", ["ppo.reward_inputs=token_ids"])
    check_reward_inputs(cfg, policy_dir, policy_dir)  # a backbone on the policy's own tokenizer
    with pytest.raises(UserError, match="ppo.reward_inputs=token_ids needs the reward model's tokenizer"):
        check_reward_inputs(cfg, policy_dir, minilm_dir())
    check_reward_inputs(cfg, None, policy_dir)  # the unbuilt policy's tokenizer is the one its build trains
    with pytest.raises(UserError, match="ppo.reward_inputs=token_ids needs the reward model's tokenizer"):
        check_reward_inputs(cfg, None, minilm_dir())
    check_reward_inputs(load_config("configs/tiny.yaml"), policy_dir, minilm_dir())  # auto: text where they differ

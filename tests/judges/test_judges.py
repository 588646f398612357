"""The judges' method on tiny models: soft labels are probabilities, swapping the responses gives 1 - p, averaging
both orders removes position bias, the hf judge reads exactly the answer tokens' softmax, d-RLAIF scores are the
expectation over 1..10, and bad judge set-ups fail with one clear error."""
import pytest
import torch
from judge_helpers import settings

from rlaif.config import load_config
from rlaif.errors import UserError
from rlaif.judges import debiased, make_judge, prompting
from rlaif.judges.constitution import score_each
from rlaif.judges.hf import HFJudge, answer_token
from rlaif.judges.rules import RulesJudge
from rlaif.models.loading import load_causal_lm, load_tokenizer

PROMPTS = ["question 3", "question 14", "tell me about rivers", "why is the sky blue"]
FIRST = ["answer 3", "answer 14 with more words", "rivers flow to the sea", "light scatters"]
SECOND = ["other 3", "other", "no", "because it is blue and the air scatters light more at short wavelengths"]
PRINCIPLES = ["Be helpful.", "Be honest.", "Be concise.", "Be kind."]


@pytest.fixture(scope="module")
def hf_judge(judge_model_dir):
    return HFJudge(settings(judge="hf", hf={"model": str(judge_model_dir)}), batch_size=3)


def test_hf_label_is_the_softmax_over_the_two_answer_tokens(hf_judge, judge_model_dir):
    widths = []  # the judge's output layer runs at the answer cue only, not at every prompt position
    hook = hf_judge.model.register_forward_hook(lambda module, args, out: widths.append(out.logits.shape[1]))
    p = hf_judge.prefer_first(PROMPTS, FIRST, SECOND, PRINCIPLES)
    hook.remove()
    assert p.shape == (4,) and ((p > 0) & (p < 1)).all() and widths == [1, 1]
    tok, model = load_tokenizer(judge_model_dir), load_causal_lm(judge_model_dir).eval()
    one, two = (tok(prompting.ANSWER_CUE + a, add_special_tokens=False).input_ids[-1] for a in prompting.ANSWERS)
    for i in range(4):  # one unpadded prompt at a time: batching and left padding must not change the label
        text = prompting.pairwise_prompt(prompting_preamble(), PRINCIPLES[i], [], PROMPTS[i], FIRST[i], SECOND[i],
                                         False)
        with torch.no_grad():
            logits = model(input_ids=tok(text, return_tensors="pt", add_special_tokens=False).input_ids).logits[0, -1]
        expected = torch.softmax(torch.stack([logits[one], logits[two]]), 0)[0]
        assert p[i].item() == pytest.approx(expected.item(), abs=1e-5)


def prompting_preamble():
    return settings().preamble


def test_a_judge_whose_tokenizer_starts_with_bos_reads_it_first_and_keeps_the_cue_when_cut(judge_model_dir, tmp_path):
    """A Llama-style judge tokenizer (a post-processor that puts <s> first): BOS leads every prompt, also one cut to
    hf.max_length, which loses its start and keeps the question and answer cue at its end."""
    import json
    import shutil

    shutil.copytree(judge_model_dir, tmp_path / "judge")
    spec = json.loads((tmp_path / "judge" / "tokenizer.json").read_text())
    bos = next(t for t in spec["added_tokens"] if t["content"] == "<s>")["id"]
    first, second = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
    spec["post_processor"] = {"type": "TemplateProcessing", "pair": [first, second],
                              "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, first],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}}}
    (tmp_path / "judge" / "tokenizer.json").write_text(json.dumps(spec))
    judge = HFJudge(settings(judge="hf", hf={"model": str(tmp_path / "judge"), "max_length": 64}), batch_size=2)
    short, long = "question 3", " ".join(f"answer {i}" for i in range(60)) + prompting.ANSWER_CUE
    enc = judge._encode([short, long])
    plain = [judge.tokenizer(text, add_special_tokens=False).input_ids for text in (short, long)]
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
    assert rows[0] == [bos, *plain[0]]
    assert len(rows[1]) == 64 and rows[1][0] == bos and rows[1][1:] == plain[1][-63:]
    assert 0 < judge.prefer_first(PROMPTS[:2], FIRST[:2], SECOND[:2], PRINCIPLES[:2]).min() < 1


def test_a_judge_model_with_fewer_positions_than_max_length_gets_inputs_that_fit(judge_model_dir, tmp_path):
    """hf.max_length (default 1024) is capped at the judge model's positions, less the rationale's tokens where it
    writes one; a rationale that leaves the input too little room is refused before any work."""
    import json
    import shutil

    from rlaif.orchestration.preflight import check_judge_model

    shutil.copytree(judge_model_dir, tmp_path / "judge")
    config = json.loads((tmp_path / "judge" / "config.json").read_text())
    (tmp_path / "judge" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 48}))
    long = " ".join(f"answer {i}" for i in range(60)) + prompting.ANSWER_CUE
    judge = HFJudge(settings(judge="hf", chain_of_thought=True, rationale_tokens=8,
                             hf={"model": str(tmp_path / "judge")}), batch_size=2)
    for room, width in ((0, 48), (8, 40)):
        enc = judge._encode([long, "question 3"], room=room)
        assert enc["input_ids"].shape[1] == width and enc["attention_mask"][0].all()
    p = judge.prefer_first([long, PROMPTS[0]], [long, FIRST[0]], SECOND[:2], PRINCIPLES[:2])
    assert ((p > 0) & (p < 1)).all()
    assert ((judge.direct_score([long], [long], PRINCIPLES[:1]).abs()) <= 1).all()
    cramped = settings(judge="hf", chain_of_thought=True, rationale_tokens=40, hf={"model": str(tmp_path / "judge")})
    for build in (lambda: HFJudge(cramped, batch_size=2), lambda: check_judge_model(tmp_path / "judge", cramped)):
        with pytest.raises(UserError, match=r"label.rationale_tokens=40 leaves the judge model's 48 positions"):
            build()


def test_swapping_the_responses_gives_one_minus_p(hf_judge):
    p_ab, *_ = debiased(hf_judge, PROMPTS, FIRST, SECOND, PRINCIPLES)
    p_ba, *_ = debiased(hf_judge, PROMPTS, SECOND, FIRST, PRINCIPLES)
    torch.testing.assert_close(p_ba, 1 - p_ab, atol=1e-6, rtol=0)


def test_averaging_both_orders_removes_the_judges_position_bias(hf_judge):
    """The tiny LM judge strongly prefers whichever response comes second (a real position bias); on identical
    responses the debiased label is exactly 0.5 while each single order is far from it."""
    same = list(FIRST)
    raw = hf_judge.prefer_first(PROMPTS, same, same, PRINCIPLES)
    assert (abs(raw - 0.5) > 0.2).all()
    p, p_ab, p_ba, consistent = debiased(hf_judge, PROMPTS, same, same, PRINCIPLES)
    torch.testing.assert_close(p, torch.full((4,), 0.5), atol=1e-6, rtol=0)
    assert not consistent.any()  # the two orders disagree: the stage reports this as position inconsistency


class PlantedBias:
    """Any judge with a fixed preference for the first position added in logit space."""

    def __init__(self, inner, bias):
        self.inner, self.bias, self.name = inner, bias, "biased"

    def prefer_first(self, *args):
        return torch.sigmoid(torch.logit(self.inner.prefer_first(*args), eps=1e-6) + self.bias)


def test_averaging_removes_a_planted_bias_and_keeps_the_unbiased_preference():
    rules = settings(judge="rules", temperature=0.5, rules={"min_words": 3, "required": ["light"]}).rules
    clean = RulesJudge(rules, 0.5)
    biased = PlantedBias(clean, bias=3.0)
    p_clean, *_ = debiased(clean, PROMPTS, FIRST, SECOND, PRINCIPLES)
    p_biased, p_ab, _, _ = debiased(biased, PROMPTS, FIRST, SECOND, PRINCIPLES)
    assert (p_clean < 0.5).any() and (p_ab > 0.5).all()  # one order alone: the bias decides, even against the truth
    assert torch.equal(p_biased > 0.5, p_clean > 0.5) and torch.equal(p_biased == 0.5, p_clean == 0.5)
    p_same, *_ = debiased(biased, PROMPTS, FIRST, FIRST, PRINCIPLES)
    torch.testing.assert_close(p_same, torch.full((4,), 0.5))


def test_direct_score_is_the_expected_score_rescaled(hf_judge, judge_model_dir):
    s = hf_judge.direct_score(PROMPTS, FIRST, PRINCIPLES)
    assert ((s >= -1) & (s <= 1)).all()
    tok, model = load_tokenizer(judge_model_dir), load_causal_lm(judge_model_dir).eval()
    text = prompting.score_prompt(prompting_preamble(), PRINCIPLES[1], PROMPTS[1], FIRST[1])
    ctx = tok(text, add_special_tokens=False).input_ids
    logps = []
    for k in prompting.SCORES:  # each candidate score scored alone, token by token
        cand = tok(prompting.score_candidate(k), add_special_tokens=False).input_ids
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ctx + cand])).logits[0].float(), -1)
        logps.append(sum(logp[len(ctx) - 1 + t, c].item() for t, c in enumerate(cand)))
    weights = torch.softmax(torch.tensor(logps), 0)
    expected = (weights * torch.arange(1, 11).float()).sum().item()
    assert s[1].item() == pytest.approx((expected - 5.5) / 4.5, abs=1e-4)
    one = [{"name": "p", "text": PRINCIPLES[1]}]  # a one-principle constitution scores exactly as direct_score
    torch.testing.assert_close(score_each(hf_judge, one, "sample", 0, ["k"], PROMPTS[1:2], FIRST[1:2]), s[1:2])


def test_chain_of_thought_and_few_shot(judge_model_dir, tmp_path):
    shots = tmp_path / "shots.jsonl"
    shots.write_text('{"prompt": "question 1", "response_1": "answer 1", "response_2": "other 1", "preferred": 2, '
                     '"rationale": "because 1."}\n')
    judge = HFJudge(settings(judge="hf", chain_of_thought=True, rationale_tokens=6, few_shot=str(shots),
                             hf={"model": str(judge_model_dir)}), batch_size=4)
    text = prompting.pairwise_prompt("P", "Be kind.", judge.examples, "q", "a", "b", True)
    assert "Response 1: answer 1" in text and "Rationale: because 1." in text and text.endswith(prompting.RATIONALE_CUE)
    p = judge.prefer_first(PROMPTS, FIRST, SECOND, PRINCIPLES)
    assert ((p > 0) & (p < 1)).all()
    assert len(judge._rationales([text])) == 1


def test_rules_judge_scores_and_labels():
    judge = make_judge(settings(judge="rules", temperature=0.25, rules={"min_words": 2, "max_words": 5,
                                                                        "required": ["sea"], "forbidden": ["no"],
                                                                        "pattern": r"\.$"}), 8)
    assert judge.check("rivers flow to the sea.") == 1.0
    assert judge.check("no") == 0.0  # too short, lacks 'sea', has 'no', no final full stop
    assert judge.check("the sea, no") == pytest.approx(2 / 4)  # length and 'sea' pass
    s = judge.direct_score(["q", "q"], ["the sea is wide.", "the sea, no"], ["x", "x"])
    assert s.tolist() == pytest.approx([1.0, 0.0])
    p = judge.prefer_first(["q"], ["the sea is wide."], ["the sea, no"], ["x"])
    assert p.item() == pytest.approx(torch.sigmoid(torch.tensor(0.5 / 0.25)).item())


def test_judge_errors_are_one_clear_line(tmp_path, judge_model_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "Preferred": 1, "response:": 2, "</s>": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    no_digits = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="</s>")
    with pytest.raises(UserError, match="no single token for the answer '1'"):
        answer_token(no_digits, prompting.ANSWER_CUE, " 1")
    import shutil

    from rlaif.orchestration.preflight import check_models

    shutil.copytree(judge_model_dir, tmp_path / "digitless")
    no_digits.save_pretrained(tmp_path / "digitless")  # the same model, a tokenizer without the answers
    with pytest.raises(UserError, match="no single token for the answer '1'"):  # before any stage runs
        check_models(load_config("configs/tiny.yaml", ["label.judge=hf", f"label.hf.model={tmp_path}/digitless"]))
    with pytest.raises(UserError, match="label.hf.model"):
        make_judge(settings(judge="hf"), 8)
    with pytest.raises(UserError, match="directory not found"):
        make_judge(settings(judge="hf", hf={"model": str(tmp_path / "nope")}), 8)
    with pytest.raises(UserError, match="base_url"):
        make_judge(settings(judge="openai"), 8)
    with pytest.raises(UserError, match="cannot score one response alone"):
        score_each(make_judge(settings(judge="openai", openai={"base_url": "http://x/v1", "model": "m"}), 8),
                   [{"name": "p", "text": "p"}], "sample", 0, ["k"], ["q"], ["a"])
    with pytest.raises(UserError, match="label.rules.pattern.*not a valid regular expression"):
        load_config(None, ["label.judge=rules", "label.rules.pattern=("])
    bad_shots = tmp_path / "bad.jsonl"
    bad_shots.write_text('{"prompt": "q"}\n')
    with pytest.raises(UserError, match="line 1: needs 'response_1'"):
        prompting.load_few_shot(str(bad_shots))


GOOD_SHOT = '{"prompt": "q", "response_1": "a", "response_2": "b", "preferred": 1}'


@pytest.mark.parametrize("bad_row, problem", [
    ('{"prompt": "q", "response_1": "a", "response_2": "b", "preferred": true}', "preferred must be the number 1 or 2"),
    ('{"prompt": "q", "response_1": "a", "response_2": "b", "preferred": 2.0}', "preferred must be the number 1 or 2"),
    ('{"prompt": "q", "response_1": "a", "response_2": "b", "preferred": "1"}', "preferred must be the number 1 or 2"),
    ('{"prompt": "q", "response_1": "a", "response_2": "b", "preferred": 1, "rationle": "x"}', "unknown key 'rationle"),
    ('{"prompt": "q", "response_1": " ", "response_2": "b", "preferred": 1}', "non-empty strings"),
    ('{"prompt": "q", "response_1": "a", "response_2": "b", "preferred": 1, "rationale": 3}', "rationale, where given"),
    ('["q", "a", "b", 1]', "must be a JSON object"),
])
def test_few_shot_rows_are_checked_whole(tmp_path, bad_row, problem):
    """A worked example goes into every judge prompt: one malformed row (a bool or float preference that prints as
    'True' or '2.0', a misspelled rationale dropped without a word) is refused, naming the line."""
    shots = tmp_path / "shots.jsonl"
    shots.write_text(f"{GOOD_SHOT}\n{bad_row}\n")
    with pytest.raises(UserError, match=f"line 2: .*{problem}"):
        prompting.load_few_shot(str(shots))
    shots.write_text("\n")
    with pytest.raises(UserError, match="has no examples"):
        prompting.load_few_shot(str(shots))
    shots.write_text(f"{GOOD_SHOT}\n")
    assert prompting.load_few_shot(str(shots))[0]["preferred"] == 1

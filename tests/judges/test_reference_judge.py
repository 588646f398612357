"""The reference judge (key-point coverage minus checkable rule breaks) and the constitution's principle modes: which
key points a response covers or ignores, rude and off-topic replies, both orders, prompts without references, and
the `all` ensemble as the mean over principles."""
import pytest
import torch

from rlaif.config import ReferenceJudgeConfig, load_config
from rlaif.errors import UserError
from rlaif.io.prompts import load_prompts
from rlaif.judges import debiased
from rlaif.judges.constitution import compare, load_constitution
from rlaif.judges.reference import (
    ReferenceJudge,
    check_points,
    content_words,
    reference_points,
    split_reference,
    stem,
)

PROMPT = "How do I pay off credit card debt?"
POINTS = ["list your debts with their interest rates", "pay the highest rate first", "stop adding new charges"]
FULL = ("Sure! To pay off credit card debt, list your debts with their interest rates, then pay the highest rate "
        "first, and finally stop adding new charges.")
HEDGE = "Maybe list your debts with their interest rates. It depends."


@pytest.fixture
def judge():
    return ReferenceJudge(ReferenceJudgeConfig(), 0.05, {PROMPT: POINTS})


def test_score_is_the_share_of_key_points_covered(judge):
    assert judge.grade(PROMPT, FULL) == {"covered": 3, "points": 3, "rude": False, "off_topic": False, "score": 1.0}
    assert judge.grade(PROMPT, HEDGE)["covered"] == 1 and judge.grade(PROMPT, HEDGE)["score"] == pytest.approx(1 / 3)
    # Inflections and word order do not matter; words the point does not have do not count
    assert judge.grade(PROMPT, "Charges: stop adding any. Rates: pay the highest one first.")["covered"] == 2
    assert judge.grade(PROMPT, "Pay off your credit card as soon as you can.")["covered"] == 0


def test_rude_and_off_topic_replies_are_penalised(judge):
    rude = judge.grade(PROMPT, FULL + " That is a stupid question though.")
    assert rude["rude"] and rude["covered"] == 3 and rude["score"] == 0.0
    assert judge.grade(PROMPT, "Figure it out yourself.")["score"] == -1.0  # rude, nothing covered
    off = judge.grade(PROMPT, "Bananas are yellow and the sky is big.")
    assert off["off_topic"] and not off["rude"] and off["score"] == -1.0
    assert not judge.grade(PROMPT, "Whatsoever you do, pay the highest rate first.")["rude"]  # whole words only


def test_pairwise_preference_in_both_orders(judge):
    prompts, first, second = [PROMPT] * 3, [FULL, HEDGE, HEDGE], [HEDGE, "Whatever. Look it up.", HEDGE]
    p, p_ab, p_ba, consistent = debiased(judge, prompts, first, second, [""] * 3)
    assert p[0] > 0.99 and p[1] > 0.99 and p[2] == 0.5
    assert consistent.all()
    torch.testing.assert_close(p_ab, p_ba)  # no position bias: a program reads no order
    reverse = debiased(judge, prompts, second, first, [""] * 3)[0]
    torch.testing.assert_close(reverse, 1 - p)


def test_prompts_without_references_are_refused(judge):
    with pytest.raises(UserError, match="has no key points"):
        judge.grade("How do I bake bread?", FULL)
    with pytest.raises(UserError, match="needs prompts with key points"):
        ReferenceJudge(ReferenceJudgeConfig(), 0.05, {})


def test_reference_answers_become_key_points(tmp_path):
    assert split_reference("Rinse the rice. Use two cups of water; simmer it covered!") == [
        "Rinse the rice.", "Use two cups of water", "simmer it covered!"]
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "Q1", "key_points": ["x y", "z"]}\n{"id": "b", "prompt": "Q2", '
                    '"reference": "Rinse rice. Simmer it."}\n{"id": "c", "prompt": "Q3"}\n')
    rows = load_prompts(load_config(None, [f"data.prompts={path}"]).data)
    assert reference_points(rows) == {"Q1": ["x y", "z"], "Q2": ["Rinse rice.", "Simmer it."]}
    path.write_text('{"prompt": "Q1", "key_points": "not a list"}\n')
    with pytest.raises(UserError, match="'key_points' must be a non-empty list of non-empty strings"):
        load_prompts(load_config(None, [f"data.prompts={path}"]).data)


def test_content_words_drop_stop_words_and_endings():
    assert content_words("The debts are listed with their rates") == {"debt", "list", "rat"}
    assert {stem(w) for w in ("rate", "rates", "rated", "rating")} == {"rat"} and stem("dishes") == stem("dish")


class PrincipleJudge:
    """Prefers the first response with a strength that depends on the principle text (to test the ensemble)."""
    name = "principle"

    def prefer_first(self, prompts, first, second, principles):
        return torch.tensor([0.9 if p == "A" else 0.6 for p in principles])


def test_all_principles_average_the_preferences(tmp_path):
    path = tmp_path / "constitution.yaml"
    path.write_text("- {name: a, text: A, contrast: not A}\n- {name: b, text: B}\n")
    principles = load_constitution(str(path))
    # Each order's value is the mean over the two principles (0.9 and 0.6); the debiased p is 0.5 for this judge
    _, p_ab, _, _, names = compare(PrincipleJudge(), principles, "all", 0, ["k1", "k2"], ["q"] * 2, ["x"] * 2,
                                   ["y"] * 2)
    torch.testing.assert_close(p_ab, torch.tensor([0.75, 0.75]))
    assert names == ["all", "all"]
    sampled = compare(PrincipleJudge(), principles, "sample", 0, [f"k{i}" for i in range(40)], ["q"] * 40, ["x"] * 40,
                      ["y"] * 40)
    assert set(sampled[4]) == {"a", "b"} and {round(v, 4) for v in sampled[1].tolist()} == {0.9, 0.6}


def test_constitution_contrast_must_be_text(tmp_path):
    path = tmp_path / "constitution.yaml"
    path.write_text("- {name: a, text: A, contrast: [1, 2]}\n")
    with pytest.raises(UserError, match="'contrast' must be a non-empty string"):
        load_constitution(str(path))


def test_text_in_other_scripts_is_graded():
    """Words of any script count (an ASCII-only pattern read Cyrillic as no words: every response off topic, every
    pair a tie); scripts without spaces are read as character pairs."""
    russian = "Как сварить рис?"
    judge = ReferenceJudge(ReferenceJudgeConfig(), 0.05, {russian: ["промойте рис", "варите пятнадцать минут"]})
    assert judge.grade(russian, "Промойте рис и варите пятнадцать минут.")["score"] == 1.0
    assert judge.grade(russian, "Не знаю, отстань.")["off_topic"] is True
    assert judge.prefer_first([russian], ["Промойте рис и варите пятнадцать минут."], ["Не знаю."]).item() > 0.99
    chinese = "怎么煮米饭？"
    judge = ReferenceJudge(ReferenceJudgeConfig(), 0.05, {chinese: ["先洗米", "煮十五分钟"]})
    assert judge.grade(chinese, "先洗米，然后煮十五分钟。")["covered"] == 2
    assert judge.grade(chinese, "我不知道。")["covered"] == 0
    assert content_words("café au lait") == {"café", "au", "lait"}  # not "caf"
    assert content_words("हिन्दी भाषा") == {"हिन्दी", "भाषा"}  # vowel signs are combining marks, part of the word
    assert content_words("Don’t, it's the dog's") == {"don't", "dog"}  # a typographic apostrophe as the plain one


def test_key_points_with_nothing_to_match_are_refused():
    """A key point of stop words or symbols alone would count as covered by every response."""
    check_points([{"id": "a", "prompt": "p", "key_points": ["wash the rice"]}])
    for point in ("do it", "that is all", "-- !"):
        with pytest.raises(UserError, match=rf"key point {point!r} of prompt 'a' has no word it can match"):
            check_points([{"id": "a", "prompt": "p", "key_points": ["wash the rice", point]}])

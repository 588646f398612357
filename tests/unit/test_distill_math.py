"""Reward-model distillation math against plain loops: the loss, pairwise agreement, Pearson and Spearman."""
import math

import pytest
import torch

from rlaif.algo.distill import distill_loss, pairwise_agreement, pearson, spearman


def test_distill_loss_is_mse_plus_the_pairwise_ranking_term():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(7, generator=g), torch.randn(7, generator=g)
    teacher[3] = teacher[5]  # a tie: that pair is not ranked
    scale, weight = 2.0, 3.0
    mse = sum(((s - t) / scale) ** 2 for s, t in zip(student.tolist(), teacher.tolist())) / 7
    terms = [math.log1p(math.exp(-(student[i] - student[j]).item() / scale))
             for i in range(7) for j in range(7) if teacher[i] > teacher[j]]
    expected = mse + weight * sum(terms) / len(terms)
    assert distill_loss(student, teacher, scale, weight).item() == pytest.approx(expected, rel=1e-5)
    assert distill_loss(student, teacher, scale, 0.0).item() == pytest.approx(mse, rel=1e-5)


def test_pairwise_agreement_counts_within_groups_only():
    teacher = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 5.0, 4.0])
    student = torch.tensor([1.0, 3.0, 2.0, 9.0, 1.0, 0.0, 1.0])
    groups = ["a", "a", "a", "b", "b", "c", "c"]
    agree = total = 0
    for i in range(7):
        for j in range(7):
            if groups[i] == groups[j] and teacher[i] > teacher[j]:
                total += 1
                agree += bool(student[i] > student[j])
    assert pairwise_agreement(student, teacher, groups) == (agree, total) == (2, 4)


def test_pearson_and_spearman_against_the_formulas():
    x = torch.tensor([1.0, 2.0, 2.0, 5.0, 7.0, 3.0])
    y = torch.tensor([2.0, 1.0, 4.0, 4.0, 9.0, 3.0])
    mx, my = sum(x.tolist()) / 6, sum(y.tolist()) / 6
    cov = sum((a - mx) * (b - my) for a, b in zip(x.tolist(), y.tolist()))
    r = cov / math.sqrt(sum((a - mx) ** 2 for a in x.tolist()) * sum((b - my) ** 2 for b in y.tolist()))
    assert pearson(x, y) == pytest.approx(r)

    def mean_ranks(values):
        ordered = sorted(values)
        return [sum(i for i, v in enumerate(ordered) if v == value) / ordered.count(value) for value in values]

    rx, ry = torch.tensor(mean_ranks(x.tolist())), torch.tensor(mean_ranks(y.tolist()))
    assert spearman(x, y) == pytest.approx(pearson(rx, ry))
    assert spearman(x, x * 3 + 1) == pytest.approx(1.0) and pearson(x, -x) == pytest.approx(-1.0)


def test_a_student_whose_loss_goes_nan_stops_before_it_is_saved(monkeypatch):
    """The teacher's steps were checked for NaN, the student's not: a student trained on NaN was saved and shipped
    (ppo.reward=student scores with it)."""
    from rlaif.config import load_config
    from rlaif.errors import UserError
    from rlaif.models import distill

    cfg = load_config("configs/tiny.yaml", ["train_rm.student.layers=1", "train_rm.student.batch_size=4",
                                            "train_rm.student.epochs=2"])
    student = torch.nn.Linear(1, 1)
    items = [{"prompt": f"p{i}", "response": "r", "teacher": float(i)} for i in range(8)]
    monkeypatch.setattr(distill, "reward", lambda engine, tokenizer, prompts, responses, length, device:
                        engine.model(torch.ones(len(prompts), 1)).squeeze(-1))
    steps = []

    def loss(scores, target, scale, weight):  # finite for three steps, then NaN
        steps.append(1)
        return distill_loss(scores, target, scale, weight) * (float("nan") if len(steps) > 3 else 1.0)

    monkeypatch.setattr(distill, "distill_loss", loss)
    with pytest.raises(UserError, match=r"^train_rm.student diverged at epoch 2 step 2: loss, grad_norm are NaN or "
                                        r"infinite \(the stage stops; nothing is committed\): lower "
                                        r"train_rm.student.lr"):
        distill.train_student(cfg, student, None, items, 16, 1.0, torch.device("cpu"))

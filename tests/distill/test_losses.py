"""Each distillation loss against a direct computation on small tensors; gradients reach only the student."""

import math

import pytest
import torch

from llmopt.distill.losses import (
    DIVERGENCES, cross_entropy, divergence_loss, hidden_loss, log_softmax_pair,
)


def probs(logits, tau=1.0):
    return torch.softmax(logits.double() / tau, -1)


def kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g), torch.tensor([1, 2, -100, 4, 0])


def direct(kind, s_row, t_row, beta, tau):
    p, q = probs(t_row, tau), probs(s_row, tau)
    if kind == "forward_kl":
        return kl(p, q)
    if kind == "reverse_kl":
        return kl(q, p)
    if kind == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    if kind == "skew_kl":
        return kl(p, beta * p + (1 - beta) * q)
    return kl(q, beta * q + (1 - beta) * p)  # skew_reverse_kl


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl"])
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_divergences_match_a_direct_computation(logits, kind, tau):
    student, teacher, labels = logits
    beta = 0.3
    got = divergence_loss(student, teacher, labels, kind, tau, beta)
    rows = [i for i in range(5) if labels[i] != -100]
    want = sum(direct(kind, student[i], teacher[i], beta, tau) for i in rows) / len(rows) * tau**2
    assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_registry_names_every_cli_choice():
    assert set(DIVERGENCES.names()) == {"forward_kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl"}


def test_jsd_ends_are_the_two_kls(logits):
    student, teacher, labels = logits
    fkl = divergence_loss(student, teacher, labels, "forward_kl")
    rkl = divergence_loss(student, teacher, labels, "reverse_kl")
    assert float(divergence_loss(student, teacher, labels, "jsd", beta=0.0)) == pytest.approx(float(fkl))
    assert float(divergence_loss(student, teacher, labels, "jsd", beta=1.0)) == pytest.approx(float(rkl))


def test_identical_distributions_give_zero(logits):
    student, _, labels = logits
    for kind in DIVERGENCES.names():
        assert float(divergence_loss(student, student.clone(), labels, kind)) == pytest.approx(0.0, abs=1e-6)


def test_teacher_topk_renormalizes_both_over_the_teachers_top_tokens(logits):
    student, teacher, labels = logits
    k = 3
    got = divergence_loss(student, teacher, labels, "forward_kl", teacher_topk=k)
    rows = [i for i in range(5) if labels[i] != -100]
    total = 0.0
    for i in rows:
        index = torch.topk(teacher[i], k).indices
        total += kl(probs(teacher[i][index]), probs(student[i][index]))
    assert float(got) == pytest.approx(total / len(rows), rel=1e-5)
    log_q, log_p = log_softmax_pair(student, teacher, 1.0, teacher_topk=k)
    assert log_q.shape == log_p.shape == (5, k)


def test_gradients_flow_only_to_the_student(logits):
    student, teacher, labels = logits
    student = student.clone().requires_grad_(True)
    teacher = teacher.clone().requires_grad_(True)
    divergence_loss(student, teacher, labels, "jsd").backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None


def test_cross_entropy_ignores_masked_positions(logits):
    student, _, labels = logits
    rows = [i for i in range(5) if labels[i] != -100]
    want = -sum(math.log(probs(student[i])[labels[i]]) for i in rows) / len(rows)
    assert float(cross_entropy(student, labels)) == pytest.approx(want, rel=1e-5)


def test_hidden_losses():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    assert float(hidden_loss(s, t, "mse")) == pytest.approx(float(((s - t) ** 2).mean()), rel=1e-6)
    cos = (s * t).sum(-1) / (s.norm(dim=-1) * t.norm(dim=-1))
    assert float(hidden_loss(s, t, "cosine")) == pytest.approx(float((1 - cos).mean()), rel=1e-5)
    t.requires_grad_(True)
    s.requires_grad_(True)
    hidden_loss(s, t, "mse").backward()
    assert t.grad is None and s.grad is not None


def test_learning_rate_schedules():
    from llmopt.distill.config import make_distill_config
    from llmopt.distill.trainer import learning_rate

    steps = make_distill_config(teacher="t", max_steps=110, lr=1.0, warmup=10)
    assert [learning_rate(s, steps) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert learning_rate(10, steps) == 1.0 and learning_rate(60, steps) == pytest.approx(0.5)
    assert learning_rate(110, steps) == pytest.approx(0.0, abs=1e-12)
    linear = make_distill_config(teacher="t", max_steps=110, lr=1.0, warmup=10, schedule="linear")
    assert learning_rate(35, linear) == pytest.approx(0.75)
    timed = make_distill_config(teacher="t", max_time="10m", lr=1.0, warmup=2)
    assert learning_rate(50, timed, elapsed=0.0) == 1.0  # steps alone never end a timed schedule
    assert learning_rate(50, timed, elapsed=300.0) == pytest.approx(0.5)
    assert learning_rate(3, timed, elapsed=600.0) == pytest.approx(0.0, abs=1e-12)
    constant = make_distill_config(teacher="t", max_steps=5, lr=1.0, warmup=0, schedule="constant")
    assert learning_rate(4, constant) == 1.0

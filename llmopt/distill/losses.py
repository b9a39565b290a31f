"""Distillation losses: pure functions of logits (and hidden states), averaged over token positions.

Shapes: student and teacher logits [T, V] (T token positions, V vocabulary), labels [T] (-100 = ignored).
Every divergence works on temperature-softened distributions p = softmax(teacher / tau) and
q = softmax(student / tau) and is multiplied by tau^2, so its gradients keep their scale as tau changes
(Hinton et al.). Log-space throughout: no log(0) for tokens with vanishing probability.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from llmopt.core.registry import Registry


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position [T] from log-probabilities [T, V]."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _mixture(log_a: torch.Tensor, log_b: torch.Tensor, weight_a: float) -> torch.Tensor:
    """log(weight_a * a + (1 - weight_a) * b) [T, V], computed in log space."""
    return torch.logaddexp(log_a + math.log(weight_a), log_b + math.log1p(-weight_a))


def forward_kl(log_q: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """KL(teacher || student): mean-seeking, the classic KD objective."""
    return _kl(log_p, log_q)


def reverse_kl(log_q: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """KL(student || teacher): mode-seeking (MiniLLM)."""
    return _kl(log_q, log_p)


def generalized_jsd(log_q: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """beta * KL(p || m) + (1 - beta) * KL(q || m) with m = beta * p + (1 - beta) * q (GKD, TRL's convention):
    beta 0 is forward KL, beta 1 reverse KL, 0.5 the symmetric JSD."""
    if beta <= 0.0:
        return forward_kl(log_q, log_p, beta)
    if beta >= 1.0:
        return reverse_kl(log_q, log_p, beta)
    log_m = _mixture(log_p, log_q, beta)
    return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)


def skew_kl(log_q: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """KL(p || beta * p + (1 - beta) * q) (DistiLLM's skew KL; beta is its alpha, 0.1 there): forward KL whose
    target never has the student's near-zero tails, so its gradients stay bounded."""
    return _kl(log_p, _mixture(log_p, log_q, beta))


def skew_reverse_kl(log_q: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """KL(q || beta * q + (1 - beta) * p) (DistiLLM's skew reverse KL)."""
    return _kl(log_q, _mixture(log_q, log_p, beta))


Divergence = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
DIVERGENCES: Registry[Divergence] = Registry("distillation loss")
for _name, _fn in (("forward_kl", forward_kl), ("reverse_kl", reverse_kl), ("jsd", generalized_jsd),
                   ("skew_kl", skew_kl), ("skew_reverse_kl", skew_reverse_kl)):
    DIVERGENCES.add(_name, _fn)


def log_softmax_pair(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
                     teacher_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q, log p) [T, V] in fp32; with teacher_topk K, both over the teacher's K most likely tokens only
    [T, K], each renormalized there (a sparse teacher: K logits per position are all it has to store)."""
    s = student_logits.float() / temperature
    t = teacher_logits.float() / temperature
    if teacher_topk:
        t, index = torch.topk(t, min(teacher_topk, t.shape[-1]), dim=-1)
        s = torch.gather(s, -1, index)
    return F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)


def divergence_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                    kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5,
                    teacher_topk: int | None = None) -> torch.Tensor:
    """Mean over the positions whose label is not -100 of tau^2 * divergence(q, p); student [T, V], teacher [T, V]
    (the teacher's gradient is never taken)."""
    keep = labels != -100
    log_q, log_p = log_softmax_pair(student_logits[keep], teacher_logits[keep].detach(), temperature, teacher_topk)
    return DIVERGENCES.get(kind)(log_q, log_p, beta).mean() * temperature**2


def cross_entropy(student_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The hard-label loss: mean next-token cross-entropy over positions whose label is not -100."""
    return F.cross_entropy(student_logits.float(), labels, ignore_index=-100)


def hidden_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str = "mse") -> torch.Tensor:
    """Distance between (projected) student hidden states and the teacher's, both [T, H]: mean squared error
    per element, or 1 - cosine similarity per position, averaged."""
    teacher = teacher.detach().float()
    student = student.float()
    if kind == "mse":
        return F.mse_loss(student, teacher)
    if kind == "cosine":
        return (1 - F.cosine_similarity(student, teacher, dim=-1)).mean()
    raise ValueError(f"unknown hidden-state loss {kind!r}: use mse or cosine")


HIDDEN_LOSSES = ("mse", "cosine")

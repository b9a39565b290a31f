"""Verifying draft tokens against the target model (pure functions).

Greedy: the drafts accepted are the longest prefix equal to the target's argmax at each position; the target's
token at the first mismatch (or after the last draft) follows them, so the output is the non-speculative greedy
output token for token.

Sampling: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Draft token x_j proposed with
probability q_j(x) is accepted with probability min(1, p_j(x) / q_j(x)); at the first rejection the token is
drawn from norm(max(0, p_j - q_j)); if all are accepted, one more is drawn from p_{k+1}. Every emitted token is
then distributed exactly as the target's p, whatever q is. A proposer that picks its token deterministically
(prompt lookup, a greedy draft model, Medusa's top-1 chain) has q_j = one-hot(x_j): accept with probability
p_j(x_j), and on rejection draw from p_j with x_j removed.
"""

from __future__ import annotations

import torch


def accept_greedy(target_tokens: list[int], drafts: list[int]) -> int:
    """How many drafts the target's argmax tokens (one per position, len(drafts) + 1) confirm."""
    accepted = 0
    for draft, target in zip(drafts, target_tokens):
        if draft != target:
            break
        accepted += 1
    return accepted


def rejection_sample(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """(drafts accepted, the token that follows them).

    target_probs [k + 1, vocab]: the target's sampling distribution at each draft position and after the last;
    draft_probs [k, vocab]: the proposer's distributions (None: each draft was chosen deterministically)."""
    uniforms = torch.rand(len(drafts), generator=generator, dtype=torch.float64).tolist()
    for j, (draft, u) in enumerate(zip(drafts, uniforms)):
        p = float(target_probs[j, draft])
        q = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        if u * q < p:  # u < min(1, p / q) without dividing by q = 0
            continue
        if draft_probs is None:
            residual = target_probs[j].clone()
            residual[draft] = 0.0
        else:
            residual = (target_probs[j] - draft_probs[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # only rounding can leave nothing: p was (numerically) all on draft
            residual = target_probs[j]
        return j, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))

"""How many tokens to speculate for a sequence: as many as its acceptance pays for at this batch's cost.

A step's time is modelled as a + b * tokens (least squares over recent steps): at batch 1 on a memory-bound
device b is small and verifying k extra tokens is nearly free; at a large batch the step is compute-bound and
every verified token costs about as much as a generated one. With per-token acceptance alpha (estimated per
sequence), k drafts yield alpha + alpha^2 + ... + alpha^k extra tokens in expectation; without speculation a
token costs c = (a + b * B) / B in a batch of B sequences. A sequence gets the k that maximizes
expected_extra(k) * c - k * (b + d), d being the proposer's measured time per drafted token, and none when no
k gains. Tensor-free.
"""

from __future__ import annotations

from collections import deque

# Beta(1, 1)-like prior on per-token acceptance before any verification; a new sequence starts from the
# proposer's acceptance over all sequences so far (a weak draft model is not re-tried at 0.5 for every request)
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0
DECAY = 0.8  # weight of a sequence's earlier verifications against its latest one
OVERALL_DECAY = 0.99
COST_WINDOW = 64  # steps the cost model is fitted on


class AdaptiveSpeculation:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.counts: dict[int, tuple[float, float]] = {}  # seq_id -> (accepted, rejected), decayed
        self.overall = (PRIOR_ACCEPTED, PRIOR_REJECTED)  # every sequence's verifications, decayed alike
        self.steps: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)  # (tokens, seconds)
        self.proposal_cost = 0.0  # seconds per drafted token (EMA)

    def acceptance(self, seq_id: int) -> float:
        accepted, rejected = self.counts.get(seq_id, self.overall)
        return accepted / (accepted + rejected)

    def cost_model(self) -> tuple[float, float] | None:
        """(a seconds per step, b seconds per token), or None until steps of different sizes were seen."""
        if len(self.steps) < 4:
            return None
        n = len(self.steps)
        mean_x = sum(x for x, _ in self.steps) / n
        mean_y = sum(y for _, y in self.steps) / n
        var = sum((x - mean_x) ** 2 for x, _ in self.steps)
        if var == 0:
            return None
        b = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in self.steps) / var)
        return max(0.0, mean_y - b * mean_x), b

    def num_tokens(self, seq_id: int, max_tokens: int, batch_size: int) -> int:
        """Drafts worth verifying for this sequence in a batch of batch_size decoding sequences."""
        if not self.enabled or max_tokens <= 0:
            return max(0, max_tokens)
        model = self.cost_model()
        if model is None:
            return max_tokens  # no measurements yet: speculate, and learn the cost from it
        a, b = model
        per_token = (a + b * batch_size) / batch_size
        alpha = self.acceptance(seq_id)
        best_k, best_gain, expected, p = 0, 0.0, 0.0, 1.0
        for k in range(1, max_tokens + 1):
            p *= alpha
            expected += p
            gain = expected * per_token - k * (b + self.proposal_cost)
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k

    def record_verification(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """A geometric model: each accepted draft is a success, a rejection (if any) one failure."""
        failed = 1.0 if num_accepted < num_drafts else 0.0
        accepted, rejected = self.counts.get(seq_id, self.overall)
        self.counts[seq_id] = (DECAY * accepted + num_accepted, DECAY * rejected + failed)
        accepted, rejected = self.overall
        self.overall = (OVERALL_DECAY * accepted + num_accepted, OVERALL_DECAY * rejected + failed)

    def record_step(self, num_tokens: int, seconds: float) -> None:
        self.steps.append((num_tokens, seconds))

    def record_proposal(self, num_drafted: int, seconds: float) -> None:
        if num_drafted:
            self.proposal_cost = 0.8 * self.proposal_cost + 0.2 * seconds / num_drafted if self.proposal_cost \
                else seconds / num_drafted

    def release(self, seq_id: int) -> None:
        self.counts.pop(seq_id, None)

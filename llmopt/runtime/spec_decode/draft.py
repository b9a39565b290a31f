"""A draft model: a smaller model with the target's tokenizer (a layer-dropped or pruned + distilled student)
proposes k tokens greedily, with its own paged KV cache in the same engine.

Each sequence has a shadow Sequence in the draft's cache. Before proposing, the shadow's tokens are set to the
target's; the draft's KV stays valid for the prefix the two share (the accepted drafts), and the rest is
recomputed with the first proposal, in one forward per step for every sequence. Then k - 1 one-token steps, each
batched over the sequences. Greedy drafts are deterministic proposals, which the target's rejection sampling
handles exactly (verify.py)."""

from __future__ import annotations

from dataclasses import replace

from llmopt.core.errors import ConfigError
from llmopt.runtime.engine.block_manager import BlockManager
from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.engine.scheduler import ScheduledSeq, SchedulerOutput
from llmopt.runtime.engine.sequence import Sequence
from llmopt.runtime.executor.model_runner import ModelRunner
from llmopt.runtime.spec_decode.proposer import PROPOSERS

GREEDY = SamplingParams(max_tokens=1 << 30, ignore_eos=True, detokenize=False)


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of a and b, known to be at least `start`."""
    n = start
    for x, y in zip(a[start:], b[start:]):
        if x != y:
            break
        n += 1
    return n


class DraftProposer:
    def __init__(self, draft_model, target_model, target_runner: ModelRunner, engine_config: EngineConfig):
        draft_vocab, target_vocab = draft_model.config.vocab_size, target_model.config.vocab_size
        if draft_vocab != target_vocab:
            raise ConfigError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's "
                              f"({target_vocab}): a draft must share the target's tokenizer")
        # (--decode-graph demands the graph of the target; the draft takes it where it can)
        config = replace(engine_config, speculative=None, decode_graph=engine_config.decode_graph and None)
        # as many tokens as the target's cache holds, in the draft's (smaller) blocks
        self.runner = ModelRunner(draft_model, config, num_blocks=target_runner.num_blocks)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, enable_prefix_cache=False)
        self.shadows: dict[int, Sequence] = {}

    def _sync(self, seq: Sequence, num_tokens: int) -> Sequence | None:
        """The shadow of seq with seq's tokens, its KV kept for their common prefix and room for the drafts."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Sequence(seq.token_ids, GREEDY, seq_id=seq.seq_id)
        else:
            known = min(shadow.num_computed_tokens, seq.num_prompt_tokens)
            keep = common_prefix(shadow.token_ids, seq.token_ids, known)
            # the newest token is always fed again: its logits give the first draft
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, keep, seq.num_tokens - 1)
            shadow.token_ids = list(seq.token_ids)
        bm = self.block_manager
        bm.truncate(shadow, shadow.num_computed_tokens)
        total = seq.num_tokens + num_tokens - 1  # the last draft is proposed, never fed to the draft model
        if not bm.can_grow(shadow, total):
            self.release(seq.seq_id)  # no room in the draft's cache: this sequence does not speculate now
            return None
        bm.grow(shadow, total)
        return shadow

    def propose(self, seqs: list[Sequence], num_tokens: dict[int, int]) -> dict[int, list[int]]:
        shadows = [(s, n) for seq in seqs if (s := self._sync(seq, n := num_tokens[seq.seq_id])) is not None]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s, _ in shadows}
        for step in range(max((n for _, n in shadows), default=0)):
            active = [s for s, n in shadows if n > step]
            out = SchedulerOutput([ScheduledSeq(s, s.num_tokens - s.num_computed_tokens) for s in active])
            tokens = self.runner.execute(out).tokens
            for shadow in active:
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.append_token(tokens[shadow.seq_id])
                drafts[shadow.seq_id].append(tokens[shadow.seq_id])
        return drafts

    def release(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)


def build_draft(config: SpeculativeConfig, hf_model, runner: ModelRunner, engine_config: EngineConfig
                ) -> DraftProposer:
    from llmopt.runtime.executor.loader import load_runtime_model

    param = next(hf_model.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    draft_model, _, _ = load_runtime_model(config.model, dtype=dtype, device=str(param.device),
                                           activations=runner.activations)
    return DraftProposer(draft_model, hf_model, runner, engine_config)


PROPOSERS.add("draft", build_draft)

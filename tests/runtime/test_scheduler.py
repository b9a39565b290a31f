"""The scheduler driven by a fake model whose next token is a function of the sequence so far: every
request's output is known in advance, so batching, chunking and preemption must not change it."""

import random

import pytest

from llmopt.runtime.engine.block_manager import BlockManager
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.scheduler import Scheduler
from llmopt.runtime.engine.sequence import Sequence

VOCAB = 50


def next_token(tokens):
    return (sum(tokens) * 31 + len(tokens)) % VOCAB


def expected_output(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def run(scheduler, seqs, max_steps=10_000):
    for seq in seqs:
        scheduler.add(seq)
    steps, batch_sizes = 0, []
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        assert not out.is_empty, "a step with unfinished requests scheduled nothing"
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled), "a sequence scheduled twice"
        for item in out.scheduled:  # the fake model "computes" KV: blocks must cover the new tokens
            assert len(item.seq.block_table) * scheduler.block_manager.block_size >= \
                item.seq.num_computed_tokens + item.num_new_tokens
        sampled = {s.seq.seq_id: next_token(s.seq.token_ids) for s in out.scheduled if s.samples}
        scheduler.postprocess(out, sampled)
        batch_sizes.append(len(out.scheduled))
        steps += 1
        assert steps < max_steps
    return steps, batch_sizes


def make_requests(n, seed=0, max_prompt=40, max_out=12):
    rng = random.Random(seed)
    return [Sequence([rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))],
                     SamplingParams(max_tokens=rng.randint(1, max_out), ignore_eos=True)) for _ in range(n)]


@pytest.mark.parametrize("num_blocks,budget,chunked", [
    (200, 2048, True), (200, 16, True), (200, 64, False), (14, 32, True), (9, 8, True), (9, 40, False),
])
def test_outputs_do_not_depend_on_budget_chunking_or_preemption(num_blocks, budget, chunked):
    # Every request fits the cache on its own (prompt + output <= num_blocks * 4 tokens).
    seqs = make_requests(20, max_prompt=20 if num_blocks < 10 else 40)
    prompts = [list(s.token_ids) for s in seqs]
    bm = BlockManager(num_blocks, block_size=4)
    scheduler = Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                          enable_chunked_prefill=chunked), bm)
    run(scheduler, seqs)
    for seq, prompt in zip(seqs, prompts):
        assert seq.finish_reason == "length"
        assert seq.output_token_ids == expected_output(prompt, seq.params.max_tokens)
    assert bm.num_available_blocks == num_blocks  # nothing leaked
    if num_blocks <= 14:
        assert scheduler.num_preemptions > 0  # the tiny cache forced recomputation


def test_a_request_larger_than_the_cache_is_refused_and_others_still_run():
    from llmopt.core.errors import ConfigError

    scheduler = Scheduler(EngineConfig(), BlockManager(4, block_size=4))
    with pytest.raises(ConfigError, match="needs 20 tokens of KV cache \\(5 blocks\\) but the cache holds 16: give "
                                          "--kv-cache-tokens 20"):
        scheduler.add(Sequence(list(range(16)), SamplingParams(max_tokens=2)))
    # the advice names the option that sized the cache, the one the user gave
    sized = Scheduler(EngineConfig(kv_cache_tokens=16), BlockManager(4, block_size=4))
    with pytest.raises(ConfigError, match="raise --kv-cache-tokens to at least 20$"):
        sized.add(Sequence(list(range(16)), SamplingParams(max_tokens=2)))
    ok = Sequence([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    run(scheduler, [ok])
    assert ok.output_token_ids == expected_output([1, 2, 3], 3)


def test_prefix_cache_hits_do_not_change_outputs():
    shared = list(range(24))
    seqs = [Sequence(shared + [i], SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(6)]
    bm = BlockManager(100, block_size=4)
    scheduler = Scheduler(EngineConfig(max_num_seqs=1), bm)  # one at a time: later ones hit the cache
    run(scheduler, seqs)
    assert [s.num_cached_tokens for s in seqs] == [0] + [24] * 5
    for seq in seqs:
        assert seq.output_token_ids == expected_output(seq.token_ids[:25], 5)


def test_fcfs_and_caps():
    seqs = make_requests(10, seed=1)
    scheduler = Scheduler(EngineConfig(max_num_seqs=3), BlockManager(500, 4))
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:3]


def test_static_batches_admit_only_when_the_batch_is_done():
    seqs = make_requests(9, seed=2)
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, policy="static"), BlockManager(500, 4))
    for seq in seqs:
        scheduler.add(seq)
    admitted_while_running = False
    while scheduler.has_unfinished:
        before = set(id(s) for s in scheduler.running)
        out = scheduler.schedule()
        new = {id(s.seq) for s in out.scheduled} - before
        if new and before:
            admitted_while_running = True
        scheduler.postprocess(out, {s.seq.seq_id: 1 for s in out.scheduled if s.samples})
    assert not admitted_while_running


def test_continuous_batching_keeps_the_batch_full():
    seqs = make_requests(30, seed=3, max_out=30)
    _, continuous = run(Scheduler(EngineConfig(max_num_seqs=8), BlockManager(1000, 4)), seqs)
    seqs = make_requests(30, seed=3, max_out=30)
    _, static = run(Scheduler(EngineConfig(max_num_seqs=8, policy="static"), BlockManager(1000, 4)), seqs)
    assert len(continuous) < len(static)  # fewer steps for the same work


def test_abort_and_stop_tokens():
    bm = BlockManager(50, 4)
    scheduler = Scheduler(EngineConfig(), bm, eos_token_id=7)
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=10))
    b = Sequence([4, 5], SamplingParams(max_tokens=10, stop_token_ids=(9,)))
    c = Sequence([6], SamplingParams(max_tokens=10))
    for seq in (a, b, c):
        scheduler.add(seq)
    out = scheduler.schedule()
    finished = scheduler.postprocess(out, {a.seq_id: 7, b.seq_id: 9, c.seq_id: 3})
    assert {s.seq_id for s in finished} == {a.seq_id, b.seq_id}
    assert a.finish_reason == "stop" and b.finish_reason == "stop"
    assert scheduler.abort(c.seq_id) and c.finish_reason == "abort"
    assert not scheduler.has_unfinished and bm.num_available_blocks == 50


def test_a_prompt_no_step_can_take_is_refused_when_it_arrives():
    """Without chunked prefill a prompt longer than --max-num-batched-tokens could never be scheduled: it waited
    forever, and every request behind it. Refused at admission, naming the option; shorter ones run."""
    from llmopt.core.errors import ConfigError
    from llmopt.runtime.engine.scheduler import check_schedulable

    config = EngineConfig(max_num_batched_tokens=4, enable_chunked_prefill=False)
    scheduler = Scheduler(config, BlockManager(64, block_size=4))
    with pytest.raises(ConfigError, match="prompt of 33 tokens .* raise --max-num-batched-tokens to at least 33 or "
                                          "drop --no-chunked-prefill"):
        scheduler.add(Sequence(list(range(33)), SamplingParams(max_tokens=2)))
    check_schedulable(33, EngineConfig(max_num_batched_tokens=4))  # (chunked: any length runs)
    ok = Sequence([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    run(scheduler, [ok])
    assert ok.output_token_ids == expected_output([1, 2, 3], 3)


def test_a_preempted_sequence_longer_than_a_step_is_recomputed_in_chunks_without_chunked_prefill():
    """A sequence preempted after its output grew past one step's budget: its recompute (prompt + output so far) is
    chunked even with chunked prefill off, or it would never run again."""
    seqs = [Sequence([i + 1] * 6, SamplingParams(max_tokens=14, ignore_eos=True)) for i in range(3)]
    prompts = [list(s.token_ids) for s in seqs]
    # 3 sequences of up to 20 tokens in 9 blocks of 4: preemptions; recomputes of 7-19 tokens, budget 8
    scheduler = Scheduler(EngineConfig(max_num_seqs=3, max_num_batched_tokens=8, enable_chunked_prefill=False),
                          BlockManager(9, block_size=4))
    run(scheduler, seqs)
    assert scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == [expected_output(p, 14) for p in prompts]

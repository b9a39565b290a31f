"""Decode steps replayed from captured graphs (executor/step_graphs.py), run on CPU with the stand-in capture (the
callable recorded and called again over the same static buffers): buckets, padding into the sink block, buffer
updates between replays and the memory reserved before the KV cache is sized — the tokens those of eager steps."""

import pytest
import torch

from llmopt.core.tiny import save_tiny_model
from llmopt.runtime.engine.config import SpeculativeConfig
from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor import platform
from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.runtime.executor.step_graphs import ReplayCapture, graph_buckets, graph_memory_bytes

# prompts of several lengths and outputs: decodes of 5, 4, 3, 2, 1 sequences as they finish (buckets 8, 4, 4, 2, 1)
PROMPTS = [[5, 9, 200, 31], list(range(40, 77)), [7] * 20, [100, 3, 60], list(range(10, 250, 3))]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=3) for n in (11, 9, 7, 5, 3)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=2)


@pytest.fixture
def captured(monkeypatch):
    """This platform captures decode steps, with the stand-in graph; the captures made are collected."""
    made = []

    class Recording(ReplayCapture):
        def capture(self, fn):
            made.append(fn)
            return super().capture(fn)

    monkeypatch.setattr(platform.Platform, "captures_steps", property(lambda self: True))
    monkeypatch.setattr(platform.Platform, "step_graph_capture", lambda self: Recording())
    return made


def engine(path, **settings) -> Engine:
    checkpoint, tok, _ = load_runtime_model(str(path), dtype="float32", activations="float")
    return Engine(checkpoint, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, activations="float",
                                                linear_kernels="fixed", **{"max_num_seqs": 6, **settings}))


def outputs(e: Engine) -> list:
    return [(o.token_ids, o.logprobs) for o in e.generate(PROMPTS, PARAMS)]


def test_buckets_end_at_the_most_sequences_a_step_takes():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_buckets(6) == [1, 2, 4, 6] and graph_buckets(1) == [1]


@pytest.mark.parametrize("decode_graph", [False, True], ids=["layer loop", "cpu decode graph"])
def test_replayed_steps_generate_what_eager_steps_do(tiny_dir, captured, decode_graph):
    eager = outputs(engine(tiny_dir, enforce_eager=True, decode_graph=decode_graph))
    e = engine(tiny_dir, decode_graph=decode_graph)
    graphs = e.runner.step_graphs
    assert graphs.buckets == [1, 2, 4, 6] and len(captured) == 4
    assert e.numerics()["step_graph_buckets"] == [1, 2, 4, 6]
    got = outputs(e)
    assert graphs.replays >= 10  # (every decode step; the prompts' steps ran eagerly)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, eager):
        assert tokens == want_tokens
        for step, want in zip(logprobs, want_logprobs):
            assert step.keys() == want.keys()
            assert all(abs(step[t] - want[t]) < 1e-5 for t in step)


def test_padding_rows_write_only_the_sink_block(tiny_dir, captured):
    e = engine(tiny_dir)
    runner = e.runner
    assert runner.kv_cache.num_blocks == runner.num_blocks + 1  # (the scheduler hands out num_blocks)
    graphs = runner.step_graphs
    assert graphs.sink_block == runner.num_blocks
    before = [t.clone() for t in runner.kv_cache.layers[0].tensors]
    # one decode of three sequences through the bucket of 4: the fourth row is padding
    from llmopt.runtime.executor.model_runner import StepInputs

    step = StepInputs([5, 6, 7], [3, 3, 3], [3, 7, 11], [0, 1, 2, 3], [4, 4, 4], [[0], [1], [2]])
    assert graphs.serves(step)
    hidden = runner.forward(step)
    assert hidden.shape[0] == 3 and graphs.replays == 1
    after = runner.kv_cache.layers[0].tensors
    changed = {int(b) for t0, t1 in zip(before, after) for b in (t0 != t1).flatten(1).any(1).nonzero().flatten()}
    assert changed == {0, 1, 2, graphs.sink_block}
    assert graphs.slot_mapping[3] == graphs.sink_slot and graphs.context_lens[3] == 1
    # the same step eagerly: the same hidden states
    e_eager = engine(tiny_dir, enforce_eager=True)
    assert e_eager.runner.step_graphs is None
    torch.testing.assert_close(hidden, e_eager.runner.forward(step), rtol=1e-6, atol=1e-6)


def test_steps_a_graph_cannot_hold_run_eagerly(tiny_dir, captured):
    graphs = engine(tiny_dir).runner.step_graphs
    from llmopt.runtime.executor.model_runner import StepInputs

    prefill = StepInputs([5, 6, 7], [0, 1, 2], [0, 1, 2], [0, 3], [3], [[0]])
    too_many = StepInputs([1] * 7, [3] * 7, list(range(7)), list(range(8)), [4] * 7, [[b] for b in range(7)])
    too_long = StepInputs([1], [3], [3], [0, 1], [4], [list(range(graphs.block_tables.shape[1] + 1))])
    assert not any(graphs.serves(s) for s in (prefill, too_many, too_long))
    # speculative verification (several tokens of a sequence a step) keeps the eager path: the same tokens
    spec = {"speculative": SpeculativeConfig.parse("ngram")}
    assert outputs(engine(tiny_dir, **spec)) == outputs(engine(tiny_dir, enforce_eager=True, **spec))


def test_the_graphs_memory_is_reserved_before_the_cache_is_sized(tiny_dir, captured, monkeypatch):
    monkeypatch.setattr(platform.Platform, "available_memory", lambda self: 4 * 2**20)  # (< 6 full contexts)
    sized = {}
    for eager in (True, False):
        checkpoint, tok, _ = load_runtime_model(str(tiny_dir), dtype="float32", activations="float")
        e = Engine(checkpoint, tok, EngineConfig(block_size=4, max_num_seqs=6, activations="float",
                                                 enforce_eager=eager, kv_cache_memory_fraction=0.5))
        sized[eager] = e.runner.kv_cache_budget
    reserve = e.runner.graph_reserve
    assert reserve == graph_memory_bytes(e.runner.decoder.config, 6, e.runner.graph_max_blocks, torch.float32) > 0
    assert sized[True] - sized[False] == reserve


def test_the_stand_in_writes_the_output_it_captured():
    source = torch.zeros(3)
    replay, out = ReplayCapture().capture(lambda: source * 2)
    source.fill_(5)
    replay()
    assert torch.equal(out, torch.full((3,), 10.0))


def test_the_triton_backend_reads_the_static_tensors():
    from llmopt.runtime.executor.attention.torch_sdpa import TorchAttention
    from llmopt.runtime.executor.attention.triton import TritonAttention

    slots, tables, lens = torch.zeros(4, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long), torch.ones(4)
    meta = TritonAttention().graph_metadata(4, slots, tables, lens, 16)
    assert meta.block_tables_tensor is tables and meta.context_lens_tensor is lens and meta.slot_mapping is slots
    assert not meta.prefills and meta.decode.contiguous and meta.decode.block_tables is tables
    assert TritonAttention.captures and not TorchAttention.captures  # (the torch decode caches its mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (scripts/gpu_check.sh runs this)")
def test_cuda_graphs_generate_what_eager_steps_do(tiny_dir):
    def run(eager: bool):
        checkpoint, tok, _ = load_runtime_model(str(tiny_dir), dtype="float32", device="cuda")
        e = Engine(checkpoint, tok, EngineConfig(block_size=16, kv_cache_bytes=2**24, max_num_seqs=6,
                                                 enforce_eager=eager))
        assert (e.runner.step_graphs is None) == eager
        return [o.token_ids for o in e.generate(PROMPTS, PARAMS)], e

    (graphs, e), (eager, _) = run(False), run(True)
    assert graphs == eager and e.runner.step_graphs.replays >= 10


def test_sampling_from_device_logits_gives_the_host_path_s_tokens(tiny_dir, monkeypatch):
    """Where logits stay on the device (a GPU), the greedy argmax runs there and only the ids cross, the logits too
    only when a row samples or reports log-probabilities: the same tokens and log-probabilities as the host path."""
    mixed = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2),
             SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=3),
             SamplingParams(max_tokens=6, ignore_eos=True)]

    def run(copies: list):
        e = engine(tiny_dir)
        greedy_only = [o.token_ids for o in e.generate(PROMPTS[:2], [mixed[0], mixed[3]])]
        after_greedy = len(copies)
        outs = [(o.token_ids, o.logprobs) for o in e.generate(PROMPTS[:4], mixed)]
        return (greedy_only, outs), after_greedy, len(copies) - after_greedy

    host, _, _ = run([])
    copies = []
    monkeypatch.setattr(platform.Platform, "logits_to_host", property(lambda self: False))
    original = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self.shape[-1]) or original(self))
    device, greedy_copies, mixed_copies = run(copies)
    assert device == host
    vocab = engine(tiny_dir).vocab_size
    assert greedy_copies == 0  # greedy-only steps moved token ids alone
    assert mixed_copies == 6 and set(copies) == {vocab}  # one [rows, vocab] copy per step of the mixed batch

"""Pipeline parallelism: stages of contiguous layers in their own processes, micro-batches in flight, the tokens
of one process."""

import os
import signal
import time

import pytest

from llmopt.core.errors import ConfigError, ParallelError
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_for_engine
from llmopt.runtime.executor.model_runner import StepInputs, step_part
from llmopt.runtime.parallel.pipeline import split_tokens
from llmopt.runtime.parallel.sharding import StagePlan

PROMPTS = [[1, 5, 9, 33, 70], [4] * 40, list(range(20, 90)), [7, 7, 8], [3] * 17]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def test_micro_batches_are_contiguous_runs_of_about_equal_tokens():
    assert split_tokens([1] * 8, 2) == [(0, 4), (4, 8)]
    assert split_tokens([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert split_tokens([5, 5], 4) == [(0, 1), (1, 2)]  # never more runs than sequences
    assert split_tokens([1, 1, 100], 3) == [(0, 1), (1, 2), (2, 3)]  # each later run keeps a sequence


def test_a_step_part_is_a_step_of_its_own():
    step = StepInputs([1, 2, 3, 4, 5], [0, 1, 0, 1, 2], [10, 11, 20, 21, 22], [0, 2, 5], [2, 3], [[0], [1]])
    part = step_part(step, 1, 2)
    assert part == StepInputs([3, 4, 5], [0, 1, 2], [20, 21, 22], [0, 3], [3], [[1]])


def test_stages_hold_contiguous_layers():
    class Config:
        num_hidden_layers = 30

    plans = [StagePlan.for_config(Config, s, 4) for s in range(4)]
    assert [p.layers for p in plans] == [(0, 8), (8, 15), (15, 23), (23, 30)]
    assert plans[0].max_layers == 8
    assert plans[0].holds("model.embed_tokens.weight") and not plans[0].holds("model.layers.8.mlp.up_proj")
    with pytest.raises(ConfigError, match="exceeds the model's 30 layers"):
        StagePlan.for_config(Config, 0, 31)


def generate(path, pp: int, **settings):
    config = EngineConfig(pipeline_parallel_size=pp, max_num_batched_tokens=32, **settings)
    model, tokenizer, _ = load_for_engine(str(path), config)
    engine = Engine(model, tokenizer, config)
    try:
        return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    finally:
        engine.close()


def test_two_stages_give_the_tokens_of_one_process(tiny_llama_dir, tiny_qwen2_dir):
    assert generate(tiny_llama_dir, 2) == generate(tiny_llama_dir, 1)
    assert generate(tiny_qwen2_dir, 2, pipeline_micro_batches=3) == generate(tiny_qwen2_dir, 1)


def test_tensor_and_pipeline_parallelism_together_are_refused():
    with pytest.raises(ConfigError, match="together are not supported"):
        EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)


def test_a_stage_killed_mid_run_ends_the_engine_with_one_line(tiny_llama_dir):
    from tests.runtime.test_tensor_parallel import _children

    before = _children()
    config = EngineConfig(pipeline_parallel_size=2)
    model, tokenizer, _ = load_for_engine(str(tiny_llama_dir), config)
    engine = Engine(model, tokenizer, config)
    worker = engine.runner.workers.processes[0]
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=500, ignore_eos=True))
    engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(ParallelError, match="stage 1|rank 1") as failure:
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - started < 30 and "\n" not in str(failure.value)
    assert _children() == before  # the other stage is gone too

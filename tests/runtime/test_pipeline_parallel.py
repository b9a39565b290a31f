"""Pipeline parallelism: stages of contiguous layers in their own processes, micro-batches in flight, the tokens
of one process."""


import pytest

from llmopt.core.errors import ConfigError
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.executor.model_runner import StepInputs, step_part
from llmopt.runtime.parallel.pipeline import split_tokens
from llmopt.runtime.parallel.sharding import StagePlan


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


def test_two_stages_give_the_tokens_of_one_process(tiny_llama_dir, tiny_qwen2_dir):
    from tests.runtime.test_tensor_parallel import generate

    assert generate(tiny_llama_dir, pipeline_parallel_size=2) == generate(tiny_llama_dir)
    assert generate(tiny_qwen2_dir, pipeline_parallel_size=2, pipeline_micro_batches=3) == generate(tiny_qwen2_dir)


def test_tensor_and_pipeline_parallelism_together_are_refused():
    with pytest.raises(ConfigError, match="together are not supported"):
        EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)


def test_a_stage_killed_mid_run_ends_the_engine_with_one_line(tiny_llama_dir):
    from tests.runtime.test_tensor_parallel import kill_rank_1_mid_run

    kill_rank_1_mid_run(tiny_llama_dir, EngineConfig(pipeline_parallel_size=2), "stage 1|rank 1")

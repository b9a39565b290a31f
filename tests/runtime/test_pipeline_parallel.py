"""Pipeline parallelism: stages of contiguous layers in their own processes, micro-batches in flight, the tokens
of one process."""


import os

import pytest
import torch

from llmopt.core.errors import ConfigError
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.executor.model_runner import StepInputs, step_part
from llmopt.runtime.distributed.pipeline import split_tokens
from llmopt.runtime.distributed.sharding import ParallelGrid, StagePlan


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


def test_the_grid_puts_each_stage_s_tensor_parallel_ranks_together():
    grid = ParallelGrid(tensor=2, stages=3)
    assert grid.world == 6
    assert [grid.coordinates(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(grid.rank(*grid.coordinates(r)) == r for r in range(6))
    assert grid.stage_ranks(1) == [2, 3]
    assert grid.describe(3) == "rank 3 (pipeline stage 1, tensor-parallel rank 1)"
    assert ParallelGrid(2, 1).describe(1) == "tensor-parallel rank 1"
    assert ParallelGrid(1, 2).describe(1) == "pipeline stage 1"


def test_a_rank_of_the_grid_loads_its_stage_s_layers_narrowed_to_its_share(tiny_llama_dir):
    """Rank 3 of 2 x 2: layers of stage 1 only, each cut to tensor-parallel rank 1's rows or columns."""
    from safetensors.torch import load_file

    from llmopt.runtime.executor.loader import load_for_engine, load_runtime_model

    full = load_file(str(tiny_llama_dir / "model.safetensors"))
    model, _, _ = load_runtime_model(str(tiny_llama_dir), shard=(1, 2), stage=(1, 2))
    stage, plan = model.stage_plan, model.shard_plan
    assert (stage.stage, plan.rank) == (1, 1)
    names = dict(model.named_weights())
    first = stage.layers[0]
    assert first > 0 and not any(n.startswith(f"model.layers.{first - 1}.") for n in names)
    for leaf in ("mlp.down_proj.weight", "self_attn.q_proj.weight"):
        name = f"model.layers.{first}.{leaf}"
        assert names[name].shape != full[name].shape  # cut: down_proj's columns, q_proj's rows
        assert torch.equal(names[name], plan.shard(name, full[name]))
    with pytest.raises(ConfigError, match="exceeds the model's"):
        load_for_engine(str(tiny_llama_dir), EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=99))


def test_two_stages_of_two_ranks_each_give_the_tokens_of_one_process(tiny_gptq_artifact):
    """TP=2 x PP=2: four processes (sharing the cores here) on the GPTQ int4 artifact, each rank's share of its
    stage packed for the int4 kernel (dense weights under the grid: the kill test below runs them)."""
    from tests.runtime.test_tensor_parallel import generate

    grid = dict(tensor_parallel_size=2, pipeline_parallel_size=2)
    # (float inputs: with 8-bit ones a tensor-parallel sum's rounding can flip an input's code, test_tensor_parallel)
    assert (generate(tiny_gptq_artifact, **grid, pipeline_micro_batches=3, activations="float")
            == generate(tiny_gptq_artifact, activations="float"))


def test_a_stage_killed_mid_run_ends_the_engine_with_one_line(tiny_llama_dir):
    from tests.runtime.test_tensor_parallel import kill_rank_1_mid_run

    kill_rank_1_mid_run(tiny_llama_dir, EngineConfig(pipeline_parallel_size=2), "stage 1|rank 1")


def test_a_rank_of_the_last_stage_killed_mid_run_ends_the_grid_s_engine_with_one_line(tiny_llama_dir):
    from tests.runtime.test_tensor_parallel import kill_rank_1_mid_run

    config = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    engine = kill_rank_1_mid_run(tiny_llama_dir, config, "rank [23]|stage 1", rank=3)
    assert not any(os.path.exists(f"/dev/shm/{segment.name}") for segment in engine.runner.workers.shm)

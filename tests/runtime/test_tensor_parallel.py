"""Tensor parallelism: the sharding plan (pure), the shared-memory all-reduce, and engines of 2 CPU ranks (gloo
+ shared memory, 1 core each) giving the tokens of one process."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from llmopt.core.errors import ConfigError, ParallelError
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_for_engine, load_runtime_model
from llmopt.runtime.distributed.group import SharedMemoryAllReduce
from llmopt.runtime.distributed.sharding import ShardPlan, head_split, split_range
from llmopt.runtime.executor.placement import rank_cores

PROMPTS = [[1, 5, 9, 33, 70], [4] * 40, list(range(20, 90)), [7, 7, 8]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
# chunked prefill (a 70-token prompt in chunks of 32) and decodes in the same steps
CONFIG = dict(max_num_batched_tokens=32)


def generate(path, **settings):
    """The greedy tokens of PROMPTS from an engine of these EngineConfig settings (closed after)."""
    config = EngineConfig(**{**CONFIG, **settings})
    model, tokenizer, _ = load_for_engine(str(path), config)
    engine = Engine(model, tokenizer, config)
    try:
        return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    finally:
        engine.close()


# --- the plan ---------------------------------------------------------------------------------------------------
def test_split_ranges_are_contiguous_and_earlier_ranks_take_the_extra():
    assert [split_range(9, 2, r) for r in range(2)] == [(0, 5), (5, 9)]
    assert [split_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]


@pytest.mark.parametrize("heads, kv_heads, world, expected", [
    (9, 3, 2, [((0, 6), (0, 2)), ((6, 9), (2, 3))]),  # SmolLM2: whole KV heads with their query groups
    (4, 2, 2, [((0, 2), (0, 1)), ((2, 4), (1, 2))]),
    (8, 1, 2, [((0, 4), (0, 1)), ((4, 8), (0, 1))]),  # one KV head: replicated, its queries split
    (8, 2, 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),
])
def test_head_split(heads, kv_heads, world, expected):
    assert [head_split(heads, kv_heads, world, r) for r in range(world)] == expected


def test_a_split_that_cannot_keep_query_groups_whole_is_refused_with_the_sizes_that_work():
    with pytest.raises(ConfigError, match="tensor-parallel-size that divides 3"):
        head_split(9, 3, 4, 0)


def _reassemble(plans, name, whole):
    """The whole tensor rebuilt from every rank's share, each placed where the plan says it came from (replicated
    KV heads land on the same place twice)."""
    out = torch.full_like(whole, float("nan"))
    module, _, kind = name.rpartition(".")
    for plan in plans:
        share = plan.shard(name, whole)
        rows, columns = plan._rows(module), plan._columns(module)
        if rows is not None:
            at = 0
            for a, b in rows:
                out[a:b] = share[at:at + b - a]
                at += b - a
        elif columns is not None and kind == "weight":
            out[:, columns[0]:columns[1]] = share
        else:
            assert share is None or torch.equal(share, whole)
            out = whole.clone()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_checkpoint_tensor_splits_and_reassembles(tiny_llama_dir, world):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    plans = [ShardPlan.for_config(config, r, world) for r in range(world)]
    kinds = set()
    for name, whole in tensors.items():
        share = plans[-1].shard(name, whole)
        kinds.add("rows" if share.shape[0] < whole.shape[0] else
                  "columns" if share.dim() == 2 and share.shape[1] < whole.shape[1] else "replicated")
        assert torch.equal(_reassemble(plans, name, whole), whole), name
    assert kinds == {"rows", "columns", "replicated"}


def test_quantized_weights_split_on_group_boundaries_and_reassemble(tmp_path):
    from llmopt.compress.api import make_config, quantize_model
    from llmopt.core.tiny import build_tiny_model

    model, tokenizer = build_tiny_model("llama", seed=0)
    result = quantize_model(model, tokenizer, make_config("rtn", bits=4, group_size=32))
    plans = [ShardPlan.for_config(model.config, r, 2) for r in range(2)]
    for name, qweight in result.qweights.items():
        shards = [p.shard(name, qweight).dequantize() for p in plans]
        dim = 1 if name.endswith(("o_proj", "down_proj")) else 0
        torch.testing.assert_close(torch.cat(shards, dim=dim), qweight.dequantize(), rtol=0, atol=0)


def test_rank_cores_split_evenly_or_as_given():
    assert rank_cores(None, 2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert rank_cores("0-2;5,7", 2, list(range(8))) == [[0, 1, 2], [5, 7]]
    with pytest.raises(ConfigError, match="give 2 non-empty core lists"):
        rank_cores("0-3", 2)
    # a core this process may not run on is refused before any process starts (a rank pinned to it would die)
    with pytest.raises(ConfigError, match=r"--dp-cores '0;9': core 9 is not among the cores this process may run "
                                          r"on \(0-3,6\)"):
        rank_cores("0;9", 2, [0, 1, 2, 3, 6], param="dp_cores")


def test_more_processes_than_the_host_runs_are_refused_before_any_starts():
    """More than PROCESSES_PER_CORE processes per core (unless --oversubscribe), or more memory than is available
    (each process's base, its weights and an explicit KV cache), named by the option that asked for them."""
    from llmopt.runtime.engine.config import PROCESSES_PER_CORE
    from llmopt.runtime.executor.placement import ENGINE_PROCESS_BYTES, check_host_fits

    plenty = 1 << 50
    check_host_fits(2 * PROCESSES_PER_CORE, "8 replicas", "data_parallel_size", EngineConfig(), 0, 2, plenty)
    with pytest.raises(ConfigError, match=r"--data-parallel-size: 9 replicas is more than 4 processes per core on "
                                          r"this host \(2 cores.*give at most 8, or --oversubscribe"):
        check_host_fits(9, "9 replicas", "data_parallel_size", EngineConfig(), 0, 2, plenty)
    check_host_fits(1000, "1000 replicas", "data_parallel_size", EngineConfig(oversubscribe=True), 0, 2, plenty)
    with pytest.raises(ConfigError, match=r"--disaggregate: 2 workers need about .* GiB.*its weights and its KV "
                                          r"cache.*start fewer"):
        check_host_fits(2, "2 workers", "disaggregate", EngineConfig(kv_cache_bytes=1 << 30), 1 << 20, 2,
                        2 * ENGINE_PROCESS_BYTES + (2 << 30))


def test_a_rank_that_dies_while_starting_ends_the_start_at_once(tiny_llama_dir, monkeypatch):
    """A spawned rank that cannot start (here: pinned to a core that does not exist, past the up-front check)
    ends rank 0's start with one line naming it, well within the start-up bound, and leaves no process."""
    from llmopt.runtime.executor import workers

    before = _children()
    monkeypatch.setattr(workers, "rank_cores", lambda spec, world, *a, **k: [[0], [4095]])
    config = EngineConfig(tensor_parallel_size=2, **CONFIG)
    model, tokenizer, _ = load_for_engine(str(tiny_llama_dir), config)
    started = time.monotonic()
    with pytest.raises(ParallelError, match="rank 1 (failed to start: OSError|exited with code 1 while starting)"):
        Engine(model, tokenizer, config)
    assert time.monotonic() - started < 60
    assert _children() == before


def test_shared_memory_all_reduce_adds_in_rank_order_without_the_compiled_op():
    # one process stands in for both ranks: rank 1 publishes first, then rank 0's call completes
    first = SharedMemoryAllReduce(0, 2)
    second = SharedMemoryAllReduce(1, 2, first.name)
    try:
        for s in (first, second):
            s.ops = None  # the Python path (the compiled one runs in every engine test below)
        a, b = torch.randn(3, 5), torch.randn(3, 5)
        second.sequence += 1
        nbytes = b.numel() * 4
        second.buffers[1, 1, :nbytes].copy_(b.view(-1).view(torch.uint8))
        second.header[1, 0] = 1
        expected = a + b
        assert torch.equal(first.all_reduce_(a), expected)
    finally:
        second.close(unlink=False)
        first.close(unlink=True)


# --- engines of 2 ranks -----------------------------------------------------------------------------------------
def test_two_ranks_give_the_tokens_of_one_process(tiny_llama_dir):
    assert generate(tiny_llama_dir, tensor_parallel_size=2) == generate(tiny_llama_dir)


def test_two_ranks_with_biases_tied_embeddings_an_odd_vocabulary_and_an_8bit_cache(tiny_qwen2_dir):
    # qwen2: q/k/v biases (split with their rows), the lm_head tied to the embedding (both split along a
    # vocabulary of 259: shares of 130 and 129)
    for settings in ({}, {"kv_cache_dtype": "int8", "fast_path": False}):
        assert generate(tiny_qwen2_dir, tensor_parallel_size=2, **settings) == generate(tiny_qwen2_dir, **settings)


@pytest.fixture(scope="module")
def gptq_artifact(tiny_gptq_artifact):
    return tiny_gptq_artifact


def test_two_ranks_of_a_gptq_int4_artifact_run_its_packed_kernels(gptq_artifact):
    model, _, _ = load_runtime_model(str(gptq_artifact), shard=(1, 2))
    methods = {type(m).__name__ for m in model.linears}
    assert methods == {"Int4PackedLinear"}, methods  # each rank's share packed for the int4 kernel
    # (float inputs: 8-bit ones, the default on CPU, are rounded from sums added in another order, so a rare
    # input on a rounding boundary flips and the tokens may part)
    assert (generate(gptq_artifact, tensor_parallel_size=2, activations="float")
            == generate(gptq_artifact, activations="float"))


def test_an_engine_needs_the_model_loaded_as_a_share(tiny_llama_dir):
    model, tokenizer, _ = load_runtime_model(str(tiny_llama_dir))
    with pytest.raises(ConfigError, match="shard=\\(rank, 2\\)"):
        Engine(model, tokenizer, EngineConfig(tensor_parallel_size=2))


def test_more_ranks_than_heads_is_refused_before_any_process_starts(tiny_llama_dir):
    with pytest.raises(ConfigError, match="exceeds the model's 4 attention heads"):
        load_for_engine(str(tiny_llama_dir), EngineConfig(tensor_parallel_size=8))


def _children() -> set[int]:
    import psutil

    def lives(process) -> bool:
        try:  # (multiprocessing's resource tracker, started with the first spawned process, lives as this one does)
            return process.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            return False

    return {p.pid for p in psutil.Process().children(recursive=True) if lives(p)}


def kill_rank_1_mid_run(model_dir, config: EngineConfig, names_it: str, rank: int = 1) -> Engine:
    """Run a long request, SIGKILL rank 1 (or `rank`) after a step: the engine must end within 30 s with one line
    matching `names_it`, every other process of it gone. Returns the (stopped) engine."""
    before = _children()
    model, tokenizer, _ = load_for_engine(str(model_dir), config)
    engine = Engine(model, tokenizer, config)
    worker = engine.runner.workers.processes[rank - 1]
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=500, ignore_eos=True))
    engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(ParallelError, match=names_it) as failure:
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - started < 30
    assert "\n" not in str(failure.value)
    assert _children() == before  # every rank stopped, nothing left waiting
    engine.close()  # (idempotent)
    return engine


def test_a_rank_killed_mid_run_ends_the_engine_with_one_line_and_no_process_left(tiny_llama_dir):
    engine = kill_rank_1_mid_run(tiny_llama_dir, EngineConfig(tensor_parallel_size=2, **CONFIG), "rank 1")
    assert not os.path.exists(f"/dev/shm/{engine.runner.workers.shm[0].name}")


def test_cli_generate_with_two_ranks_prints_the_one_process_text(tiny_llama_dir):
    from typer.testing import CliRunner

    from llmopt.cli.main import app

    # (fp32: the equality holds there; auto is bf16 on CPUs with bf16 units)
    args = ["generate", str(tiny_llama_dir), "--prompt", "def main():", "--max-tokens", "12", "--dtype", "float32"]
    placement = os.sched_getaffinity(0), torch.get_num_threads()
    one = CliRunner().invoke(app, args)
    two = CliRunner().invoke(app, args + ["--tensor-parallel-size", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert two.stdout == one.stdout
    # rank 0 ran pinned to its core; the command gave this thread its cores and threads back
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == placement


def test_torchrun_with_two_processes_prints_the_one_process_text(tiny_llama_dir):
    from typer.testing import CliRunner

    from llmopt.cli.main import app
    from llmopt.runtime.executor.placement import free_port

    args = ["generate", str(tiny_llama_dir), "--prompt", "class Foo:", "--max-tokens", "12", "--dtype", "float32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = CliRunner().invoke(app, args)  # (in this process: a third interpreter cost ~10 s of CI time)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "llmopt", *args, "--tensor-parallel-size", "2"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert one.exit_code == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout  # rank 0 prints; the other rank prints nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it)")
def test_the_nccl_path_of_one_rank_reduces_and_gathers_on_the_device():
    """The collectives over NCCL with one rank (a single lent GPU): the group's all-reduce and vocabulary gather
    on CUDA tensors, as a TP engine's decoder calls them."""
    import torch.distributed as dist

    from llmopt.runtime.distributed.group import TensorParallelGroup
    from llmopt.runtime.distributed.sharding import ParallelGrid
    from llmopt.runtime.executor.workers import free_port, join_group

    device = torch.device("cuda")
    everyone, _ = join_group(0, ParallelGrid(1, 1), f"tcp://127.0.0.1:{free_port()}", device)
    group = TensorParallelGroup(0, 1, None, everyone)
    try:
        x = torch.randn(4, 576, device=device)
        assert torch.equal(group.all_reduce(x.clone()), x)
        logits = torch.randn(3, 259, device=device)
        assert torch.equal(group.gather_vocab(logits, [259]), logits)
    finally:
        dist.destroy_process_group()

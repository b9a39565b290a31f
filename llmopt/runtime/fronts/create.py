"""The engine a command asks for: one Engine, the data-parallel front, or the disaggregated one."""

from __future__ import annotations

from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.executor.loader import load_for_engine
from llmopt.runtime.fronts.data_parallel import DataParallelEngine
from llmopt.runtime.fronts.disaggregated import DisaggregatedEngine


def create_engine(model_name: str, config: EngineConfig, dtype: str = "float32", device: str = "cpu",
                  trust_remote_code: bool = False, record_steps: bool = True):
    """The engine for MODEL: one Engine (its model loaded here; under tensor parallelism this process's share),
    or with config.data_parallel_size > 1 the DataParallelEngine of that many replicas, or under
    --disaggregate P:D the DisaggregatedEngine of P prefill and D decode workers."""
    if config.data_parallel_size > 1:
        return DataParallelEngine(model_name, config, dtype, device, trust_remote_code, record_steps)
    if config.disaggregation is not None:
        return DisaggregatedEngine(model_name, config, dtype, device, trust_remote_code, record_steps)
    model, tokenizer, _ = load_for_engine(model_name, config, dtype=dtype, device=device,
                                          trust_remote_code=trust_remote_code)
    return Engine(model, tokenizer, config, record_steps=record_steps)

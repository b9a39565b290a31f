"""Load a MODEL for the runtime: the checkpoint's config and weights by name (models.RuntimeCheckpoint), read
without building a transformers model; each quantized linear of an artifact becomes the linear method the registry
chooses for its scheme, the engine's input-activation setting and the device (runtime.executor.linear)."""

from __future__ import annotations

from llmopt.core.adapters import adapter_for
from llmopt.core.config_checks import check_config
from llmopt.core.errors import ConfigError
from llmopt.core.models import (
    DTYPES, check_tensor_shapes, load_config, load_tokenizer, resolve_dtype_name, resolve_model,
)
from llmopt.runtime.engine.config import ACTIVATION_SCHEMES
from llmopt.runtime.executor.linear import make_linear
from llmopt.runtime.executor.models import MODEL_FAMILIES, RuntimeCheckpoint, model_class_for
from llmopt.runtime.executor.models.weights import checkpoint_weights, module_weights
from llmopt.runtime.distributed.group import launched_rank
from llmopt.runtime.distributed.sharding import ParallelGrid, ShardPlan, StagePlan


def load_runtime_model(name: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False,
                       activations: str = "float", shard: tuple[int, int] | None = None,
                       stage: tuple[int, int] | None = None):
    """(checkpoint, tokenizer, source) for the engine: a RuntimeCheckpoint of a local folder, alias or artifact
    (dense, GPTQ / AWQ / compressed-tensors, pruned); a hub model is loaded through transformers first.
    activations: EngineConfig.activations ("int8": 8-bit dynamic inputs where a linear method has them).
    shard: (rank, world) to load one tensor-parallel rank's share (distributed.sharding.ShardPlan); stage: (stage,
    stages) to load one pipeline stage's layers (StagePlan); the checkpoint keeps the arguments (`load_args`)
    the engine's other ranks load theirs with."""
    import torch

    source = resolve_model(name)
    dtype = resolve_dtype_name(dtype, device)
    config = load_config(source, trust_remote_code)
    adapter_for(config)  # unsupported families fail here, naming the supported ones
    model_class = model_class_for(config.model_type)  # ... and families the runtime has no class for
    plan = stage_plan = None
    parallel = (shard is not None and shard[1] > 1) or (stage is not None and stage[1] > 1)
    if parallel and not model_class.tensor_parallel:
        sharded = [n for n in MODEL_FAMILIES.names() if MODEL_FAMILIES.get(n).tensor_parallel]
        raise ConfigError(f"tensor and pipeline parallelism run the {', '.join(sharded)} model types; run "
                          f"{config.model_type} in one process", param="tensor_parallel_size")
    if parallel and source.path is None:
        raise ConfigError(f"parallel ranks load their share from a local checkpoint: save {source.name} to a "
                          "folder first and give the folder", param="tensor_parallel_size")
    if shard is not None and shard[1] > 1:
        plan = ShardPlan.for_config(config, *shard)
    if stage is not None and stage[1] > 1:
        stage_plan = StagePlan.for_config(config, *stage)
    input_activations = ACTIVATION_SCHEMES[activations]
    torch_dtype, torch_device = DTYPES[dtype], torch.device(device)
    # sizes, and for dense weights the memory they take, before any tensor is read
    check_config(config, None if source.kind == "artifact" else torch_dtype.itemsize, source.name)
    if source.path is not None:
        check_tensor_shapes(config, source.path, source.name)  # also refuses pickle-only / corrupt safetensors

    def linear_for(qweight):
        return make_linear(qweight, torch_dtype, torch_device, input_activations)

    if source.path is None:  # a hub id: transformers fetches and loads it
        from llmopt.formats.load import load_model

        model, tokenizer, source = load_model(source, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                              linear_factory=lambda qw, _dtype, _device: linear_for(qw))
        return RuntimeCheckpoint(model.config, module_weights(model), activations), tokenizer, source
    shard_of = _share(plan, stage_plan)
    weights = checkpoint_weights(source.path, torch_dtype, torch_device, linear_for, shard=shard_of)
    load_args = dict(name=name, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                     activations=activations)
    checkpoint = RuntimeCheckpoint(config, weights, activations, shard_plan=plan, stage_plan=stage_plan,
                                   load_args=load_args)
    return checkpoint, load_tokenizer(source, trust_remote_code), source


def _share(plan: ShardPlan | None, stage_plan: StagePlan | None):
    """shard(name, value) for checkpoint_weights: the stage's layers, each narrowed to the tensor-parallel share."""
    if plan is None or stage_plan is None:
        return next((p.shard for p in (plan, stage_plan) if p is not None), None)

    def shard(name: str, value):
        return None if (held := stage_plan.shard(name, value)) is None else plan.shard(name, held)

    return shard


def load_for_engine(name: str, config, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
    """load_runtime_model for an engine of `config` (EngineConfig): its input activations, and under tensor or
    pipeline parallelism this process's share (rank 0, or torchrun's rank: its stage's layers, narrowed to its
    tensor-parallel share)."""
    grid = ParallelGrid(config.tensor_parallel_size, config.pipeline_parallel_size)
    return load_runtime_model(name, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                              activations=config.activations_on(device), **grid.share(launched_rank()))

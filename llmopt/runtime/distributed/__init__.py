"""Tensor and pipeline parallelism below the models, on torch.distributed: how a checkpoint is split (sharding:
ShardPlan, StagePlan, ParallelGrid), a rank's group and its collectives (group: all-reduce, vocabulary gather),
and the hand-off between pipeline stages (pipeline). The rank processes that hold these are the executor's
(executor/workers.py); the engine fronts that run several engines are above the Engine (runtime/fronts)."""

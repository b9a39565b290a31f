"""Tensor parallelism on torch.distributed: how a model is split (sharding), the ranks' group and its
collectives (group), the worker processes and the driver's command channel (workers)."""

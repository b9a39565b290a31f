"""Training checkpoints in safetensors + JSON (no pickle): the trainable state, the optimizer's moments, the RNG
states and the step counters, written into a temporary folder and renamed into place, so a crash mid-write
leaves the previous checkpoint whole."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmopt.core.errors import ConfigError
from llmopt.core.io import atomic_output_dir, read_json, save_tensors, write_json

STATE_FILE = "state.json"
MODEL_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The optimizer's per-parameter state as flat tensors ("state.{index}.{key}") and its param groups."""
    state = optimizer.state_dict()
    tensors = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            tensors[f"state.{index}.{key}"] = (value if torch.is_tensor(value) else torch.tensor(value)).contiguous()
    return tensors, state["param_groups"]


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(folder: Path, trainable: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                    counters: dict, settings: dict) -> None:
    """Replace `folder` with a checkpoint of this moment; `settings` (the run's configuration) are kept beside
    the counters, for a resume to compare with its own."""
    opt_tensors, groups = optimizer_tensors(optimizer)
    with atomic_output_dir(folder, overwrite=True) as tmp:
        save_tensors({k: v.detach().contiguous() for k, v in trainable.items()}, tmp / MODEL_FILE)
        save_tensors({**opt_tensors, "rng.torch": torch.get_rng_state()}, tmp / OPTIMIZER_FILE)
        write_json(tmp / STATE_FILE, {**counters, "settings": settings, "param_groups": groups,
                                      "python_random": _jsonable(random.getstate())})


def checkpoint_settings(folder: Path) -> dict | None:
    """The settings the checkpoint in `folder` was trained with (None: none there, or written before checkpoints
    recorded them), read without loading any tensor."""
    if not (folder / STATE_FILE).is_file():
        return None
    return read_json(folder / STATE_FILE).get("settings")


def has_checkpoint(folder: Path) -> bool:
    return (folder / STATE_FILE).is_file()


def load_checkpoint(folder: Path, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(trainable tensors, counters) of the checkpoint in `folder`; restores the optimizer and RNG states."""
    if not (folder / STATE_FILE).is_file():
        raise ConfigError(f"--resume: no checkpoint in {folder}; run without --resume to start over")
    state = read_json(folder / STATE_FILE)
    tensors = load_file(str(folder / OPTIMIZER_FILE))
    torch.set_rng_state(tensors.pop("rng.torch"))
    load_optimizer(optimizer, tensors, state.pop("param_groups"))
    random.setstate(_tupled(state.pop("python_random")))
    state.pop("settings", None)
    return load_file(str(folder / MODEL_FILE)), state


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value

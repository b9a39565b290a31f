"""Outputs appear whole or not at all."""

import json
import os

import pytest

from llmopt.core.io import atomic_output_dir, write_json


def test_write_json_replaces_whole_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "sub" / "facts.json"
    write_json(path, {"a": 1})
    write_json(path, {"a": 2, "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": 2, "b": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["facts.json"]


def test_write_json_failing_midway_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "facts.json"
    write_json(path, {"old": True})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["facts.json"]


def test_atomic_output_dir_removes_a_failed_folder(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_output_dir(tmp_path / "out") as tmp:
            (tmp / "half.json").write_text("{")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []

"""Threads that follow the cores other processes leave free (core.core_share): the measurement from /proc/stat
less this process's own time, niced time left out, and a unit of work run with that many threads and nothing
changed outside it."""

import pytest
import torch

from llmopt.core import core_share
from llmopt.core.core_share import CoreShare


class Clock:
    """/proc/stat's busy ticks of the cores, this process's ticks and the time, as a test sets them."""

    def __init__(self, monkeypatch):
        self.now, self.busy, self.own = 0.0, 0, 0
        monkeypatch.setattr(core_share, "_cpu_ticks", lambda cores: self.busy)
        monkeypatch.setattr(core_share, "_own_ticks", lambda: self.own)
        monkeypatch.setattr(core_share.time, "monotonic", lambda: self.now)

    def advance(self, seconds: float, own_cores: float, other_cores: float, tick: int) -> None:
        self.now += seconds
        self.own += round(own_cores * seconds * tick)
        self.busy += round((own_cores + other_cores) * seconds * tick)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_busy_process_on_one_of_two_cores_leaves_one_thread(monkeypatch, two_threads):
    clock = Clock(monkeypatch)
    share = CoreShare()
    share.cores = {0, 1}
    assert share.threads(2) == 2  # (no measurement before interval_s has passed: all cores)
    clock.advance(1.5, own_cores=1.2, other_cores=0.9, tick=share.tick)
    with share.limited() as threads:
        assert threads == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2  # put back after the unit of work
    clock.advance(0.3, own_cores=1.0, other_cores=0.0, tick=share.tick)
    assert share.threads(2) == 1  # (within interval_s: the last measurement stands)
    clock.advance(1.0, own_cores=1.0, other_cores=0.1, tick=share.tick)  # the other process stopped
    with share.limited() as threads:
        assert threads == 2 and torch.get_num_threads() == 2
    clock.advance(1.0, own_cores=1.5, other_cores=0.4, tick=share.tick)  # a light neighbour: both threads stay
    assert share.threads(2) == 2 and share.threads(1) == 1


def test_niced_processes_are_not_competition_and_only_this_process_s_cores_count(tmp_path, monkeypatch):
    """The busy ticks read from /proc/stat: user, system, irq, softirq and steal of the given CPUs; not nice (a
    niced process yields to this one), not idle, not other CPUs."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 900 900 900 0 0 0 0 0 0\n"
                    "cpu0 100 500 20 1000 7 1 2 3 0 0\n"
                    "cpu1 10 0 2 1000 0 0 0 0 0 0\n"
                    "cpu2 999 0 999 0 0 0 0 0 0 0\nintr 5\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path,
                                                                             *a, **k))
    assert core_share._cpu_ticks({0, 1}) == (100 + 20 + 1 + 2 + 3) + (10 + 2)


def test_an_engine_step_runs_with_the_free_cores_and_leaves_the_count_as_it_was(tiny_llama_dir, monkeypatch,
                                                                                  two_threads):
    from llmopt.runtime.engine.config import EngineConfig
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams
    from llmopt.runtime.executor.loader import load_runtime_model

    model, tok, _ = load_runtime_model(str(tiny_llama_dir))
    engine = Engine(model, tok, EngineConfig())
    seen = []
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda out: seen.append(torch.get_num_threads()) or execute(out))
    monkeypatch.setattr(CoreShare, "measure", lambda self: 1.0)  # one of the two cores taken by another process
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    fixed = Engine(model, tok, EngineConfig(adaptive_threads=False))
    assert fixed.core_share is None

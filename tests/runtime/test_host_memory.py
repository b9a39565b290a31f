import sys

import pytest

from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.executor import host_memory


@pytest.fixture(autouse=True)
def fresh_cache():
    host_memory.keep_freed_host_memory.cache_clear()
    yield
    host_memory.keep_freed_host_memory.cache_clear()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_takes_the_thresholds():
    # CI runs on glibc Linux: if mallopt stopped being called (or refused), this fails
    assert host_memory.keep_freed_host_memory() is True


def test_opt_out(monkeypatch):
    monkeypatch.setenv("LLMOPT_KEEP_HOST_MEMORY", "0")
    assert host_memory.keep_freed_host_memory() is False


def test_cpu_runner_asks_for_it(monkeypatch):
    from llmopt.core.tiny import build_tiny_model
    from llmopt.runtime.executor import model_runner

    calls = []
    monkeypatch.setattr(model_runner, "keep_freed_host_memory", lambda: calls.append(1))
    model, _ = build_tiny_model()
    model_runner.ModelRunner(model, EngineConfig(block_size=4, kv_cache_bytes=1 << 20))
    assert calls == [1]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_headroom_is_the_tightest_limit_on_the_way_up(tmp_path):
    write(tmp_path / "self" / "cgroup", "0::/pod/app\n")
    write(tmp_path / "fs" / "pod" / "app" / "memory.max", "max\n")
    write(tmp_path / "fs" / "pod" / "app" / "memory.current", "100\n")
    write(tmp_path / "fs" / "pod" / "memory.max", "4096\n")  # the pod's limit binds
    write(tmp_path / "fs" / "pod" / "memory.current", "1000\n")
    assert host_memory.cgroup_memory_headroom(str(tmp_path / "self" / "cgroup"), str(tmp_path / "fs")) == 3096


def test_cgroup_v1_headroom_and_no_limit(tmp_path):
    write(tmp_path / "self" / "cgroup", "4:memory:/box\n3:cpuset:/\n")
    write(tmp_path / "fs" / "memory" / "box" / "memory.limit_in_bytes", "2000\n")
    write(tmp_path / "fs" / "memory" / "box" / "memory.usage_in_bytes", "2500\n")
    write(tmp_path / "fs" / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "none"
    write(tmp_path / "fs" / "memory" / "memory.usage_in_bytes", "5\n")
    assert host_memory.cgroup_memory_headroom(str(tmp_path / "self" / "cgroup"), str(tmp_path / "fs")) == 0
    write(tmp_path / "fs" / "memory" / "box" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert host_memory.cgroup_memory_headroom(str(tmp_path / "self" / "cgroup"), str(tmp_path / "fs")) is None
    assert host_memory.cgroup_memory_headroom(str(tmp_path / "missing"), str(tmp_path / "fs")) is None


def test_the_cpu_kv_budget_stays_inside_the_cgroup(monkeypatch):
    import psutil
    import torch

    from llmopt.runtime.executor import host_memory
    from llmopt.runtime.executor.platform import Platform

    now = psutil.virtual_memory()  # (held still: the host's available memory moves between two reads)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: now)
    monkeypatch.setattr(host_memory, "cgroup_memory_headroom", lambda: 1 << 20)  # a container with 1 MiB left
    assert Platform.of(torch.device("cpu")).available_memory() == 1 << 20
    monkeypatch.setattr(host_memory, "cgroup_memory_headroom", lambda: None)
    assert Platform.of(torch.device("cpu")).available_memory() == psutil.virtual_memory().available


# --- weights in transparent huge pages ------------------------------------------------------------------------------
def thp_offered() -> bool:
    """Whether this kernel hands out transparent huge pages on request (its mode is `always` or `madvise`)."""
    from llmopt.core.hardware import thp_mode

    mode = thp_mode()
    return mode is not None and not mode.startswith("never")


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps), in kB."""
    inside, huge = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                huge = int(line.split()[1])
    return huge


def tied_model():
    """An embedding and a head tied to it (4 MiB between them), a buffer, a detached view kept as a plain
    attribute; and a second module holding another view of the embedding (the checkpoint's model) beside a
    weight of its own."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(2048, 256), nn.Linear(256, 2048))
    model[1].weight = model[0].weight
    model[1].register_buffer("codes", torch.randint(-8, 8, (1001,), dtype=torch.int8))
    model[1].narrow = model[1].weight.detach()[3:7]
    checkpoint = nn.Module()
    checkpoint.embed = nn.Parameter(model[0].weight.detach(), requires_grad=False)
    checkpoint.own = nn.Linear(8, 8)
    return model, checkpoint


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings with madvise")
def test_weights_move_into_one_huge_page_region_keeping_identity_values_and_ties():
    import mmap

    import torch

    model, checkpoint = tied_model()
    tensors = {"embed": model[0].weight, "bias": model[1].bias, "codes": model[1].codes,
               "narrow": model[1].narrow, "checkpoint": checkpoint.embed}
    values = {name: t.clone() for name, t in tensors.items()}
    own = checkpoint.own.weight.data_ptr()
    moved = host_memory.weights_to_huge_pages(model, sharing=(checkpoint,))
    # the embedding's storage once (tied), the bias and the codes, each rounded up to a cache line
    assert moved == 2048 * 256 * 4 + 2048 * 4 + 1024
    base = model[0].weight.data_ptr()
    for name, t in tensors.items():
        assert t is {"embed": model[0].weight, "bias": model[1].bias, "codes": model[1].codes,
                     "narrow": model[1].narrow, "checkpoint": checkpoint.embed}[name]  # the same objects
        assert torch.equal(t, values[name]), name
        assert base <= t.data_ptr() < base + moved, name
    assert model[1].weight.data_ptr() == base == checkpoint.embed.data_ptr()  # still one storage
    assert model[1].narrow.data_ptr() == base + 3 * 256 * 4
    assert checkpoint.own.weight.data_ptr() == own  # the sharing module's own weights stay where they were
    model[0].weight.data[5, 1] = 42.0  # still views of one memory
    assert model[1].narrow[2, 1].item() == 42.0 == checkpoint.embed[5, 1].item()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert base % host_memory.HUGE_PAGE_BYTES == 0
        if thp_offered():
            assert anon_huge_kb(base) >= 2048  # (at least one 2 MiB page of the 4 MiB written)


def test_weights_stay_put_when_asked_or_too_small(monkeypatch):
    from torch import nn

    model, checkpoint = tied_model()
    before = model[0].weight.data_ptr()
    monkeypatch.setenv("LLMOPT_WEIGHTS_HUGE_PAGES", "0")
    assert host_memory.weights_to_huge_pages(model, sharing=(checkpoint,)) == 0
    monkeypatch.delenv("LLMOPT_WEIGHTS_HUGE_PAGES")
    small = nn.Linear(64, 64)  # (less than a huge page: not worth a mapping)
    small_ptr = small.weight.data_ptr()
    assert host_memory.weights_to_huge_pages(small) == 0 and small.weight.data_ptr() == small_ptr
    assert model[0].weight.data_ptr() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings with madvise")
def test_an_engine_over_weights_in_huge_pages_generates_what_it_did_before(monkeypatch):
    import torch

    from llmopt.core.tiny import build_tiny_model
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 200, 31], list(range(40, 77))]
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("LLMOPT_WEIGHTS_HUGE_PAGES", setting)
        model, tok = build_tiny_model(vocab_size=8192)  # a 2 MiB embedding and head: enough to move
        engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=1 << 20))
        runner = engine.runner
        runs[setting] = [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]
        if setting == "1":
            assert runner.weights_in_huge_pages >= 2 * 8192 * 64 * 4
            weights = dict(runner.decoder.named_parameters())
            base = min(t.data_ptr() for t in weights.values())  # (one region holds them all)
            for name, tensor in weights.items():
                assert base <= tensor.data_ptr() < base + runner.weights_in_huge_pages, name
            # the checkpoint's model shares the moved memory rather than holding a second copy
            assert model.model.embed_tokens.weight.data_ptr() == runner.decoder.embed.weight.data_ptr()
            assert torch.equal(model.lm_head.weight, runner.decoder.lm_head.weight)
        else:
            assert runner.weights_in_huge_pages == 0
    assert runs["1"] == runs["0"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings with madvise")
def test_buffers_only_prefill_reads_stay_where_they_are():
    # another layout of the same codes, read by compute-bound prefill GEMMs (a linear method's
    # prefill_only_buffers), is not worth the move's start-up time
    import torch
    from torch import nn

    class Method(nn.Module):
        prefill_only_buffers = ("panels",)

        def __init__(self):
            super().__init__()
            self.register_buffer("codes", torch.ones(3 << 20, dtype=torch.int8))
            self.register_buffer("panels", torch.ones(3 << 20, dtype=torch.int8))

    method = Method()
    panels = method.panels.data_ptr()
    assert host_memory.weights_to_huge_pages(nn.Sequential(method)) == 3 << 20
    assert method.panels.data_ptr() == panels and method.codes.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0

import torch

from llmopt.core.adapters import adapter_for, decoder_layers, get_module
from llmopt.core.calibration import run_layerwise
from llmopt.core.tiny import build_tiny_model


class Recorder:
    """Records every linear's inputs; optionally zeroes one linear per layer to check the recompute."""

    def __init__(self, zero: str | None = None, sequential: bool = True):
        self.inputs, self.zero, self.sequential = {}, zero, sequential
        self.order = []

    def stages(self, adapter):
        return list(adapter.sequential) if self.sequential else [adapter.linears]

    def add_batch(self, layer_index, name, module, inputs):
        self.inputs.setdefault((layer_index, name), []).append(inputs.reshape(-1, inputs.shape[-1]).clone())

    def process(self, layer_index, layer, names):
        self.order.append((layer_index, names))
        if self.zero in names:
            get_module(layer, self.zero).weight.data.zero_()


def reference_inputs(model, ids):
    """Each linear's inputs from a plain forward of the (current) model."""
    adapter = adapter_for(model)
    seen, handles = {}, []
    for i, layer in enumerate(decoder_layers(model)):
        for name in adapter.linears:
            def hook(module, args, key=(i, name)):
                seen.setdefault(key, []).append(args[0].reshape(-1, args[0].shape[-1]).clone())
            handles.append(get_module(layer, name).register_forward_pre_hook(hook))
    with torch.no_grad():
        for batch in ids.split(3):
            model(input_ids=batch)
    for h in handles:
        h.remove()
    return {k: torch.cat(v) for k, v in seen.items()}


def test_pipeline_feeds_each_linear_exactly_what_a_full_forward_does():
    model, _ = build_tiny_model("llama", seed=0)
    ids = torch.randint(0, 256, (7, 16), generator=torch.Generator().manual_seed(0))
    rec = Recorder()
    run_layerwise(model, ids, rec, batch_size=3)
    expected = reference_inputs(model, ids)
    assert set(rec.inputs) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(torch.cat(rec.inputs[key]), value, rtol=1e-5, atol=1e-5)
    adapter = adapter_for(model)
    assert rec.order == [(i, names) for i in range(2) for names in adapter.sequential]


def test_later_layers_see_the_changed_weights():
    model, _ = build_tiny_model("qwen2", seed=0)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    rec = Recorder(zero="mlp.down_proj", sequential=False)
    run_layerwise(model, ids, rec, batch_size=4)
    # The model now has zeroed down_proj weights everywhere; a plain forward must agree with what
    # layer 1 was fed during calibration (so layer 0's outputs were recomputed after the change).
    expected = reference_inputs(model, ids)
    torch.testing.assert_close(torch.cat(rec.inputs[(1, "self_attn.q_proj")]), expected[(1, "self_attn.q_proj")],
                               rtol=1e-5, atol=1e-5)


class ReferenceRecorder(Recorder):
    """Asks for the uncompressed model's inputs too (as GPTAQ does) and perturbs every linear it processes."""

    uses_reference_inputs = True

    def __init__(self):
        super().__init__()
        self.references = {}

    def add_batch(self, layer_index, name, module, inputs, reference=None):
        super().add_batch(layer_index, name, module, inputs)
        self.references.setdefault((layer_index, name), []).append(reference.reshape(-1, reference.shape[-1]).clone())

    def process(self, layer_index, layer, names):
        super().process(layer_index, layer, names)
        for name in names:
            get_module(layer, name).weight.data.mul_(0.5)


def test_reference_stream_is_the_original_model_and_the_main_stream_the_changed_one():
    import copy

    model, _ = build_tiny_model("llama", seed=0)
    original = copy.deepcopy(model)
    ids = torch.randint(0, 256, (7, 16), generator=torch.Generator().manual_seed(2))
    rec = ReferenceRecorder()
    run_layerwise(model, ids, rec, batch_size=3)
    before, after = reference_inputs(original, ids), reference_inputs(model, ids)
    for key in before:
        torch.testing.assert_close(torch.cat(rec.references[key]), before[key], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat(rec.inputs[key]), after[key], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before[(1, "mlp.down_proj")], after[(1, "mlp.down_proj")])


class StageOnlyRecorder(ReferenceRecorder):
    """Changes only its stage's linears, and says so: later passes replay the attention from cached inputs."""

    changes_only_stage_linears = True


def _count_attention_passes(model, module="self_attn"):
    counts = {}
    for i, layer in enumerate(decoder_layers(model)):
        def hook(module, args, kwargs, key=i):
            counts[key] = counts.get(key, 0) + 1
        getattr(layer, module).register_forward_pre_hook(hook, with_kwargs=True)
    return counts


def test_replayed_attention_feeds_the_same_inputs_and_skips_the_attention():
    import copy

    for compute_dtype in (torch.float32, torch.bfloat16):
        model, _ = build_tiny_model("llama", seed=0)
        original = copy.deepcopy(model)
        ids = torch.randint(0, 256, (7, 16), generator=torch.Generator().manual_seed(2))
        rec = StageOnlyRecorder()
        if compute_dtype == torch.float32:  # (a bf16 runner is a copy: its hooks are not the model's)
            counts = _count_attention_passes(model)
            norm_counts = _count_attention_passes(model, "input_layernorm")
        run_layerwise(model, ids, rec, batch_size=3, compute_dtype=compute_dtype)
        if compute_dtype == torch.float32:
            # 3 batches x 2 streams (the reference layer is a copy, hooks included) x 2 passes: the q/k/v
            # stage's (stops inside) and the o stage's (caches o's inputs); the gate/up and down stages and the
            # output recompute replay. Without replay: 3 x (5 + 4) = 27.
            assert counts == {0: 12, 1: 12}
            assert norm_counts == counts  # the input norm feeds only the attention: skipped with it
        before, after = reference_inputs(original.to(compute_dtype), ids), reference_inputs(model.to(compute_dtype), ids)
        tolerance = 1e-5 if compute_dtype == torch.float32 else 6e-2  # bf16: rounding in different places
        for key in before:
            torch.testing.assert_close(torch.cat(rec.references[key]).float(), before[key].float(),
                                       rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(torch.cat(rec.inputs[key]).float(), after[key].float(),
                                       rtol=tolerance, atol=tolerance)


def test_algorithms_that_may_change_other_weights_are_not_replayed():
    model, _ = build_tiny_model("llama", seed=0)
    ids = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(3))
    counts = _count_attention_passes(model)
    run_layerwise(model, ids, Recorder(), batch_size=3)
    assert counts == {0: 10, 1: 10}  # 2 batches x (4 stages + the recompute)


def test_linears_fed_the_same_input_are_handed_it_without_running_the_first():
    """q/k/v (and gate/up) share one input: the stage pass stops at the first of them, so no projection runs
    just to reach the next one's hook. Counts the linears that actually ran, per layer."""
    model, _ = build_tiny_model("llama", seed=0)
    ids = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(3))
    adapter = adapter_for(model)
    runs = {}
    for i, layer in enumerate(decoder_layers(model)):
        for name in adapter.linears:
            def hook(module, args, output, key=(i, name.rsplit(".", 1)[1])):
                runs[key] = runs.get(key, 0) + 1
            get_module(layer, name).register_forward_hook(hook)
    rec = Recorder()
    run_layerwise(model, ids, rec, batch_size=3)
    # Per batch (no replay for this recorder): the q/k/v stage runs none of them; q/k/v run in the o, gate/up
    # and down stages and the recompute; gate/up in the down stage and the recompute.
    expected = {"q_proj": 4, "k_proj": 4, "v_proj": 4, "o_proj": 3, "gate_proj": 2, "up_proj": 2, "down_proj": 1}
    assert runs == {(i, name): 2 * count for i in range(2) for name, count in expected.items()}
    for layer in range(2):  # and each of them got the shared input
        for first, other in (("self_attn.q_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            assert len(rec.inputs[(layer, other)]) == 2
            assert all(torch.equal(a, b) for a, b in zip(rec.inputs[(layer, first)], rec.inputs[(layer, other)]))

import copy

import pytest
import torch

from llmopt.core.tiny import build_tiny_model
from llmopt.compress.config import StructuredConfig
from llmopt.compress.structured import head_dim_of, plan_pruning, prune_structured
from llmopt.core.adapters import adapter_for, decoder_layers

IDS = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
CAL = dict(calib="pystdlib", num_samples=4, seqlen=32)


def zero_pruned(model, plan) -> None:
    """Zero, in the original model, what the plan removes, so it computes what the smaller model does
    (the reference for the smaller model: MLP channels -> down columns; heads -> o_proj columns; layers ->
    their o_proj and down_proj, leaving only the residual)."""
    from llmopt.core.adapters import get_module

    config, adapter = model.config, adapter_for(model)
    head_dim = head_dim_of(config)
    with torch.no_grad():
        for i, layer in enumerate(decoder_layers(model)):
            down = get_module(layer, adapter.sequential[-1][0])
            o_proj = get_module(layer, adapter.sequential[1][0])
            if plan.kind == "mlp":
                removed = sorted(set(range(down.in_features)) - set(plan.keep[i]))
                down.weight[:, removed] = 0
            elif plan.kind == "heads":
                removed = sorted(set(range(config.num_attention_heads)) - set(plan.keep[i]))
                o_proj.weight.view(o_proj.out_features, -1, head_dim)[:, removed] = 0
            elif i not in plan.keep_layers:
                o_proj.weight.zero_()
                down.weight.zero_()
                for linear in (o_proj, down):
                    if linear.bias is not None:
                        linear.bias.zero_()


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind,ratio,overrides", [
    ("mlp", 0.25, {}),
    ("heads", 0.5, {}),  # 4 heads in 2 KV groups: removes one query head per group
    ("heads", 0.5, dict(num_attention_heads=4, num_key_value_heads=4)),  # MHA: removes whole KV groups
    ("layers", 0.5, dict(num_hidden_layers=4)),
])
def test_smaller_model_equals_original_with_pruned_parts_zeroed(tmp_path, family, kind, ratio, overrides):
    from transformers import AutoModelForCausalLM

    model, tok = build_tiny_model(family, seed=0, **overrides)
    config = StructuredConfig(structured=kind, ratio=ratio, channel_multiple=16, calibration=CAL)
    small, plan, facts = prune_structured(model, tok, config)
    assert facts["num_parameters_after"] < facts["num_parameters_before"]
    reference = copy.deepcopy(model)
    zero_pruned(reference, plan)
    torch.testing.assert_close(logits(small), logits(reference), rtol=1e-4, atol=1e-4)
    # ...and transformers loads it as an ordinary checkpoint.
    small.save_pretrained(tmp_path / "small")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "small").eval()
    torch.testing.assert_close(logits(loaded), logits(small))
    assert sum(p.numel() for p in loaded.parameters()) == facts["num_parameters_after"]


def test_gqa_plan_keeps_config_uniform():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                                  num_hidden_layers=2, intermediate_size=1536)
    scores = torch.rand(2, 9)
    plan = plan_pruning(config, "heads", 0.25, scores)
    assert plan.config_updates == {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 64}
    assert all(len(k) == 6 for k in plan.keep.values())
    for kept in plan.keep.values():  # two query heads from every group of three
        assert [sum(1 for h in kept if h // 3 == g) for g in range(3)] == [2, 2, 2]
    mlp = plan_pruning(config, "mlp", 0.25, torch.rand(2, 1536), channel_multiple=64)
    assert mlp.config_updates == {"intermediate_size": 1152}


def test_scores_replay_gives_the_same_model(tmp_path):
    from safetensors.torch import save_file

    model, tok = build_tiny_model("llama", seed=0)
    config = StructuredConfig(structured="mlp", ratio=0.5, channel_multiple=16, calibration=CAL)
    small, plan, _ = prune_structured(model, tok, config)
    save_file({"scores": plan.scores}, str(tmp_path / "scores.bin"))
    replay = StructuredConfig(structured="mlp", ratio=0.5, channel_multiple=16, scores_file=str(tmp_path / "scores.bin"))
    again, plan2, _ = prune_structured(model, tok, replay)
    assert plan2.keep == plan.keep
    torch.testing.assert_close(logits(again), logits(small))

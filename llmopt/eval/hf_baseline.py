"""Generation through transformers' `generate`: the reference path the runtime is compared against."""

from __future__ import annotations

import torch

from llmopt.runtime.engine.sampling import SamplingParams


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids per prompt; with `chat`, the tokenizer's chat template with a generation prompt."""
    if not chat:
        return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    if not getattr(tokenizer, "chat_template", None):
        from llmopt.core.errors import ConfigError

        raise ConfigError("--chat: this model's tokenizer has no chat template; drop --chat and give the prompt "
                          "already formatted", param="chat")
    ids = []
    for prompt in prompts:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return ids


def pad_token_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


def left_padded(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest] with each prompt at the right end, so every row's new tokens
    start in the same column (transformers' batched generate needs left padding)."""
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention_mask[i, width - len(ids):] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def hf_generate(model, tokenizer, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """New token ids per prompt, one left-padded batch through `model.generate`."""
    device = next(model.parameters()).device
    pad_id = pad_token_id(tokenizer)
    input_ids, attention_mask = left_padded(prompt_ids, pad_id)
    width = input_ids.shape[1]
    if params.seed is not None:
        torch.manual_seed(params.seed)
    kwargs = dict(max_new_tokens=params.max_tokens, pad_token_id=pad_id)
    if params.is_greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
    if params.ignore_eos:
        kwargs.update(eos_token_id=None, min_new_tokens=params.max_tokens)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)
    new_tokens = out[:, width:].tolist()
    eos = tokenizer.eos_token_id
    results = []
    for row in new_tokens:  # cut at the first EOS / padding
        if not params.ignore_eos and eos is not None and eos in row:
            row = row[: row.index(eos)]
        results.append(row)
    return results

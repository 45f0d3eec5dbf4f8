"""Hugging Face transformers greedy generation: the correctness reference."""

from __future__ import annotations

import copy

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:  # noqa: ANN001
    """Greedy continuation of one unpadded prompt, ignoring EOS, as token ids."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    # No EOS at all (rather than min_new_tokens, which would mask EOS logits), so the
    # reference keeps going exactly as `ignore_eos=True` does.
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # None falls back to the model config's EOS
    config.pad_token_id = 0
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    for k in ("temperature", "top_p", "top_k"):
        setattr(config, k, None)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_greedy_picks(model, prompt_ids: list[int], token_ids: list[int]) -> list[int]:  # noqa: ANN001
    """Transformers' greedy pick after the prompt and after each prefix of `token_ids`, in
    one forward over them all. These picks equal `token_ids` exactly when `token_ids` is
    transformers' greedy continuation (each token is its pick given the ones before), so
    a generation is checked in one forward instead of one decode step per token."""
    ids = torch.tensor([prompt_ids + token_ids[:-1]], dtype=torch.long, device=model.device)
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt_ids) - 1:].argmax(-1).tolist()

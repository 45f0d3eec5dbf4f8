"""Tandem: prefill/decode disaggregated LLM serving."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import tandem.kvtransfer` never pulls in the engine and torch.
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tandem.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)

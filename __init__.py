"""Tandem: prefill/decode disaggregated LLM serving."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["LLM", "SamplingParams"]

# This package's own directory must not be on the path: `python -m` from the checkout's
# root puts the working directory there, and then its subpackages import as top-level
# names that shadow real ones (`kernels` is Hugging Face's too, which transformers imports).
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]


def __getattr__(name: str) -> Any:
    # Lazy, so `import tandem.kvtransfer` never pulls in the engine and torch.
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tandem.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)

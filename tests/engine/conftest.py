"""The engine tier's shared engine."""

from __future__ import annotations

import pytest

from tests.support.engines import running_engine


@pytest.fixture(scope="session")
def smol():
    """SmolLM2 on the CPU: a 512-token context, 4 slots (the engine `specstream generate`
    makes with `--n-ctx 512`). Tests leave it idle and unchanged."""
    with running_engine("smollm2", n_ctx=512, n_slots=4) as eng:
        yield eng

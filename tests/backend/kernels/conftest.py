from __future__ import annotations

import pytest

from backend.kernels import native


@pytest.fixture(params=["native", "graphs"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once on the hand-written kernels (``native``) and once with them off, on
    the Inductor graphs that machines without them use."""
    if request.param == "graphs":
        monkeypatch.setattr(native, "_tried", True)
        monkeypatch.setattr(native, "_lib", None)
    elif not native.available():
        pytest.skip("no native Q4 kernels here (they need x86-64 with AVX2 and a C compiler)")
    return request.param

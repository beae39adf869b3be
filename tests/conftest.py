import os

import pytest

os.environ.setdefault("ORTMLX_TEST", "1")
# Calls answer as they did before kernels built behind them (tuning build_behind): the suite counts traces and
# compiled calls, which would otherwise depend on how fast the builder thread is. test_build_behind.py turns it on.
os.environ.setdefault("ORTMLX_TUNING", "build_behind=0")


@pytest.fixture(scope="session", autouse=True)
def _register():
    import ortmlx
    ortmlx.register(genai=False)

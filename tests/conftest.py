import os

import pytest

os.environ.setdefault("ORTMLX_TEST", "1")


@pytest.fixture(scope="session", autouse=True)
def _register():
    import ortmlx
    ortmlx.register(genai=False)

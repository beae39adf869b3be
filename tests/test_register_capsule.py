"""Regression: registering the EP after Python code looked up an attribute on a PyCapsule
(``import torch`` does) used to hang forever in cffi's embedding start-up (Python < 3.12)."""
import subprocess
import sys

CODE = """
import datetime
getattr(datetime.datetime_CAPI, "no_such_attribute", None)   # tags PyCapsule_Type's version
import ortmlx
ortmlx.register(genai=False)
print("registered")
"""


def test_register_after_capsule_attribute_lookup():
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("registered")

"""``ep.errors.guarded``: nothing escapes into C, even while the interpreter tears modules down."""
from __future__ import annotations

import sys

from ortmlx.ep import errors


class _Abi:
    def __init__(self):
        self.made = []

    def status(self, code, msg):
        self.made.append((code, msg))
        return "status"


def _boom(_abi, *args):
    raise ValueError("bad input")


def test_exception_becomes_status_naming_the_callback():
    abi = _Abi()
    assert errors.guarded("Compute")(_boom)(abi) == "status"
    code, msg = abi.made[0]
    assert code == errors.ORT_EP_FAIL and "Compute" in msg and "ValueError: bad input" in msg


def test_reporting_survives_module_teardown(monkeypatch, capsys):
    """At exit ORT may call back after the module's globals are cleared (None): the wrapper still
    returns its default instead of raising into C."""
    wrapped = errors.guarded("ReleaseEp", default="dflt", status=False)(_boom)
    status_wrapped = errors.guarded("Compute", default=None)(_boom)
    monkeypatch.setattr(errors, "format_error", None)
    monkeypatch.setattr(errors, "ORT_EP_FAIL", None)
    assert wrapped(_Abi()) == "dflt"
    assert "ValueError: bad input" in capsys.readouterr().err
    abi = _Abi()
    assert status_wrapped(abi) == "status" and abi.made[0][0] == 11
    monkeypatch.setattr(sys, "stderr", None)
    assert wrapped(_Abi()) == "dflt"                # nowhere to write: still no exception

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


def test_our_failures_carry_node_and_code():
    """Our exceptions share ``OrtmlxError``: its node is named, its code is the status's; a node given to the
    wrapper (the compute callback's group) wins."""
    from ortmlx.errors import InjectedFault, KernelError, UserError

    def raiser(exc):
        def fn(_abi, *args):
            raise exc
        return fn

    abi = _Abi()
    errors.guarded("Compute")(raiser(InjectedFault("boom", node="n1")))(abi)
    errors.guarded("Compute")(raiser(UserError("bad")))(abi)
    errors.guarded("Compute", node_of=lambda e, *a: "grp")(raiser(KernelError("k")))(abi)
    (c1, m1), (c2, m2), (c3, m3) = abi.made
    assert c1 == errors.ORT_EP_FAIL and "Compute [n1]: boom (at " in m1
    assert c2 == errors.ORT_INVALID_ARGUMENT and m2.endswith("Compute: bad")
    assert c3 == errors.ORT_EP_FAIL and "Compute [grp]: k" in m3 and not errors.is_bug(KernelError("k"))

"""The project's exception types (imports nothing of ortmlx: every layer raises them).

- ``UserError``: the user's mistake (an option, an input's type or shape): reported in one line naming the
  option or node and the valid values, never with a traceback.
- ``KernelError``: a node failed while its group was built or run (the message names the node); one line too,
  with where it was raised.
- ``OrtmlxError``: the base of both (and of the ABI layer's own), carrying the node and status code the ABI
  layer reports.
Anything else escaping into ORT is a bug of ours: one line in the status, the traceback once on stderr.
"""
from __future__ import annotations

ORT_FAIL, ORT_INVALID_ARGUMENT, ORT_NOT_IMPLEMENTED, ORT_EP_FAIL = 1, 2, 9, 11


class OrtmlxError(Exception):
    """One of our reported failures: ``node``, the node it concerns, and ``code``, its ORT status code (None: not
    known here; the ABI layer names the group and reports ORT_EP_FAIL)."""
    node: str | None = None
    code: int | None = None

    def __init__(self, *args, node: str | None = None, code: int | None = None):
        super().__init__(*args)
        if node is not None:
            self.node = node
        if code is not None:
            self.code = code


class UserError(OrtmlxError, ValueError):
    """A user's mistake: one line, no traceback (ORT_INVALID_ARGUMENT)."""
    code = ORT_INVALID_ARGUMENT


class KernelError(OrtmlxError, RuntimeError):
    """A translator failed on a node; the message names the node."""


class InjectedFault(OrtmlxError, RuntimeError):
    """A failure the ``fault`` tuning knob asked for (testing): reported like a node's failure."""

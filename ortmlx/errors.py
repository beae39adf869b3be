"""The project's exception types (imports nothing of ortmlx: every layer raises them).

- ``UserError``: the user's mistake (an option, an input's type or shape): reported in one line naming the
  option or node and the valid values, never with a traceback.
- ``KernelError``: a node failed while its group was built or run (the message names the node); one line too,
  with where it was raised.
Anything else escaping into ORT is a bug of ours: one line in the status, the traceback once on stderr.
"""
from __future__ import annotations

ORT_FAIL, ORT_INVALID_ARGUMENT, ORT_NOT_IMPLEMENTED, ORT_EP_FAIL = 1, 2, 9, 11


class UserError(ValueError):
    """A user's mistake: one line, no traceback (ORT_INVALID_ARGUMENT)."""
    code = ORT_INVALID_ARGUMENT


class KernelError(RuntimeError):
    """A translator failed on a node; the message names the node."""


class InjectedFault(RuntimeError):
    """A failure the ``fault`` tuning knob asked for (testing): reported like a node's failure."""

    def __init__(self, msg: str, node: str | None = None):
        super().__init__(msg)
        self.node = node

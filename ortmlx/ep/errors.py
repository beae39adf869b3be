"""Exceptions -> OrtStatus: the one wrapper every C callback goes through.

An exception escaping a cffi callback returns NULL, which ORT reads as *success*; so every callback is
wrapped by ``guarded``, which turns any exception into an ``OrtStatus`` naming the EP, where it happened and
the node or group when known. The status is one line: a user's mistake (``UserError``, an ``EpError`` of
ORT_INVALID_ARGUMENT) says what and the valid values; a node's failure (``KernelError``) adds where it was
raised; anything else is a bug of ours, whose traceback is written to stderr once.
"""
from __future__ import annotations

import functools
import os
import sys
import traceback

from ..errors import ORT_EP_FAIL, ORT_FAIL, ORT_INVALID_ARGUMENT, ORT_NOT_IMPLEMENTED, OrtmlxError, UserError

EP_NAME = "MLXExecutionProvider"
__all__ = ["EP_NAME", "ORT_EP_FAIL", "ORT_FAIL", "ORT_INVALID_ARGUMENT", "ORT_NOT_IMPLEMENTED", "EpError",
           "OrtCallError", "format_error", "guarded", "is_bug"]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class OrtCallError(OrtmlxError, RuntimeError):
    """An ORT C API call returned a non-NULL status."""


class EpError(OrtmlxError, RuntimeError):
    """An EP failure with a status code and the node it concerns."""

    def __init__(self, msg: str, code: int = ORT_EP_FAIL, node: str | None = None):
        super().__init__(msg, node=node, code=code)


def is_bug(exc: BaseException) -> bool:
    """Whether ``exc`` is none of the failures we report as such (a bug of ours: its traceback is shown)."""
    return not isinstance(exc, OrtmlxError)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _origin(exc: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame that raised ``exc`` or its deepest cause."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if not frames:
        return ""
    f = frames[-1]
    path = f.filename
    if path.startswith(_PKG):
        path = "ortmlx" + path[len(_PKG):]
    return f" (at {path}:{f.lineno})"


def format_error(where: str, exc: BaseException, node: str | None = None) -> str:
    """The status message for ``exc``: one line naming ``node``, else the node ``exc`` carries."""
    node = node or (exc.node if isinstance(exc, OrtmlxError) else None)
    head = f"{EP_NAME} {where}" + (f" [{node}]" if node else "")
    if isinstance(exc, UserError) or (isinstance(exc, EpError) and exc.code == ORT_INVALID_ARGUMENT):
        return f"{head}: {_one_line(exc)}"
    if not is_bug(exc):
        return f"{head}: {_one_line(exc)}{_origin(exc)}"
    return f"{head}: internal error, {type(exc).__name__}: {_one_line(exc)}{_origin(exc)} (traceback on stderr)"


def guarded(where: str, default=None, status: bool = True, node_of=None):
    """Decorate a callback body ``fn(abi_owner, *args)``.

    ``status=True``: the callback returns ``OrtStatus*`` and an exception becomes a status created with the
    owner's API. ``status=False``: the callback returns a value (or nothing); an exception is logged to stderr
    and ``default`` returned. The first argument's ``.abi`` gives the API. ``node_of(exc, *args)``: the node or
    group the message names (default: the node the exception carries).
    """
    # bound here: at interpreter exit ORT may still call back after this module's globals are cleared
    fmt, bug, the_sys, fail_code, tb, ours = format_error, is_bug, sys, ORT_EP_FAIL, traceback, OrtmlxError

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(abi, *args):
            try:
                return fn(abi, *args)
            except BaseException as e:  # noqa: BLE001 - nothing may escape into C
                try:
                    msg = fmt(where, e, node_of(e, *args) if node_of is not None else None)
                    if bug(e):
                        the_sys.stderr.write(f"{msg}\n{''.join(tb.format_exception(type(e), e, e.__traceback__))}")
                    if not status:
                        if not bug(e):
                            the_sys.stderr.write(msg + "\n")
                        return default
                    code = e.code if isinstance(e, ours) and e.code is not None else fail_code
                    return abi.status(code, msg)
                except BaseException:  # noqa: BLE001 - even reporting failed (interpreter teardown)
                    return default
        return wrapper
    return deco

"""Exceptions -> OrtStatus: the one wrapper every C callback goes through.

An exception escaping a cffi callback returns NULL, which ORT reads as
*success*; so every callback is wrapped by ``guarded``, which turns any
exception into an ``OrtStatus`` naming the EP, where it happened, the node (when
known) and the Python traceback.
"""
from __future__ import annotations

import functools
import sys
import traceback

EP_NAME = "MLXExecutionProvider"
ORT_FAIL, ORT_INVALID_ARGUMENT, ORT_NOT_IMPLEMENTED, ORT_EP_FAIL = 1, 2, 9, 11


class OrtCallError(RuntimeError):
    """An ORT C API call returned a non-NULL status."""


class EpError(RuntimeError):
    """An EP failure with a status code and the node it concerns."""

    def __init__(self, msg: str, code: int = ORT_EP_FAIL, node: str | None = None):
        super().__init__(msg)
        self.code = code
        self.node = node


def format_error(where: str, exc: BaseException, node: str | None = None) -> str:
    node = node or getattr(exc, "node", None)
    head = f"{EP_NAME} {where}" + (f" [node {node}]" if node else "")
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{head}: {type(exc).__name__}: {exc}\n{tb}"


def guarded(where: str, default=None, status: bool = True):
    """Decorate a callback body ``fn(abi_owner, *args)``.

    ``status=True``: the callback returns ``OrtStatus*`` and an exception becomes a
    status created with the owner's API. ``status=False``: the callback returns a
    value (or nothing); an exception is logged to stderr and ``default`` returned.
    The first argument's ``.abi`` (or the callable ``abi_of(args)``) gives the API.
    """
    # bound here: at interpreter exit ORT may still call back after this module's globals are cleared
    fmt, the_sys, fail_code = format_error, sys, ORT_EP_FAIL

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(abi, *args):
            try:
                return fn(abi, *args)
            except BaseException as e:  # noqa: BLE001 - nothing may escape into C
                try:
                    msg = fmt(where, e)
                    if not status:
                        the_sys.stderr.write(msg)
                        return default
                    return abi.status(getattr(e, "code", fail_code), msg)
                except BaseException:  # noqa: BLE001 - even reporting failed (interpreter teardown)
                    return default
        return wrapper
    return deco

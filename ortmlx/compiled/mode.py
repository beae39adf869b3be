"""``compile_mode`` (enabled|no_fuse|no_simplify|disabled) -> MLX's global compile mode.

MLX's Python API (0.32) has no ``set_compile_mode``; libmlx exports
``mlx::core::set_compile_mode(CompileMode)``. We call it through ctypes only after
checking the enum's order in the installed header; if anything does not check out,
the mode cannot be honoured and the group runs eagerly (never a silently different mode).
The mode is process-wide in MLX: the most recently created session's mode wins.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import re
import threading

_ENUM = ("disabled", "no_simplify", "no_fuse", "enabled")
_SYMBOL = "_ZN3mlx4core16set_compile_modeENS0_11CompileModeE"
_lock = threading.Lock()
_state = {"current": "enabled", "fn": None, "why": None}


def _mlx_root() -> str:
    import mlx.core as mx
    return os.path.dirname(os.path.abspath(mx.__file__))


def _header_enum(root: str) -> tuple[str, ...] | None:
    path = os.path.join(root, "include", "mlx", "compile.h")
    try:
        text = open(path, encoding="utf-8").read()
    except OSError:
        return None
    m = re.search(r"enum\s+class\s+CompileMode\s*\{([^}]*)\}", text)
    return tuple(x.strip() for x in m.group(1).split(",") if x.strip()) if m else None


def _setter():
    """ctypes handle of ``set_compile_mode`` (None and a reason when unavailable)."""
    if _state["fn"] is not None or _state["why"] is not None:
        return _state["fn"], _state["why"]
    fn, why = None, None
    try:
        root = _mlx_root()
        if _header_enum(root) != _ENUM:
            why = "cannot confirm MLX's CompileMode enum from its header"
        else:
            libs = sorted(glob.glob(os.path.join(root, "lib", "libmlx.*")))
            if not libs:
                why = "libmlx not found"
            else:
                f = getattr(ctypes.CDLL(libs[0]), _SYMBOL)
                f.argtypes, f.restype = [ctypes.c_int], None
                fn = f
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {e}"
    _state["fn"], _state["why"] = fn, why
    return fn, why


def apply_compile_mode(mode: str) -> str | None:
    """Set MLX's compile mode; returns why it could not be (None: done)."""
    if mode not in _ENUM:
        return f"unknown compile_mode {mode!r}"
    with _lock:
        if mode == _state["current"]:
            return None
        fn, why = _setter()
        if fn is None:
            return f"compile_mode={mode} unavailable: {why}"
        fn(_ENUM.index(mode))
        _state["current"] = mode
    return None


def current_mode() -> str:
    return _state["current"]


@contextlib.contextmanager
def unfused():
    """MLX traces inside the block without fusing (``no_fuse``), then the mode set before: MLX reads the mode when
    it traces (a closure's call with new shapes), so a closure first called here keeps MLX's own kernels, no fused
    ones to build. Nothing changes where the mode is not ``enabled`` or cannot be set."""
    with _lock:
        before = _state["current"]
        fn = _setter()[0] if before == "enabled" else None
        if fn is not None:
            fn(_ENUM.index("no_fuse"))
        try:
            yield
        finally:
            if fn is not None:
                fn(_ENUM.index(before))


def unfused_calls(fn):
    """``fn`` (an ``mx.compile`` closure) with each call inside ``unfused``: its traces keep MLX's own kernels."""
    def call(*args):
        with unfused():
            return fn(*args)
    return call

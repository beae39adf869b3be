"""Provider options and environment variables, read once at EP creation.

Five user options, each a provider option (``providers=[("MLXExecutionProvider", {"device": "cpu"})]``, which
ORT hands over as session config entries ``ep.mlxexecutionprovider.<key>``) or an environment variable; a
provider option wins. ``tuning`` is the developer's (``ortmlx/tuning.py``). A bad key or value fails EP creation
with one line naming the option and its valid values.
"""
from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass, field

from ..errors import UserError
from ..kernels import REGISTRY
from ..tuning import ENV as TUNING_ENV
from ..tuning import ENV_ONLY, Tuning
from ..tuning import keys as tuning_keys

PREFIX = "ep.mlxexecutionprovider."
SWITCH_TRUE = ("1", "true", "on", "yes")
SWITCH_FALSE = ("", "0", "false", "off", "no")
#: the compiled paths ``no_compile`` can turn off one by one
COMPILE_PATHS = ("general", "prefill", "decode")
DEVICES = ("auto", "cpu", "gpu")

def from_pairs(pairs: list[str], flag: str, example: str = "no_compile=1", prog: str = "") -> dict:
    """Command-line ``KEY=VALUE`` strings (``-o``, ``--mlx-option``, ...) as a provider-options dict; a string
    without ``=`` ends the program with one line naming the flag, with an example."""
    opts = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep:
            raise SystemExit(f"{prog}{flag} {p!r}: give key=value (e.g. {flag} {example})")
        opts[key.strip()] = value.strip()
    return opts


#: option -> (environment variables, first found wins; help)
SPEC: dict[str, tuple[tuple[str, ...], str]] = {
    "device": (("ORTMLX_DEVICE",), "auto|cpu|gpu: where MLX runs (auto: the GPU when MLX has one)"),
    "no_compile": (("ORTMLX_NO_COMPILE", "ONNX_GENAI_MLX_NO_COMPILE", "ONNXRUNTIME_EP_MLX_NO_COMPILE"),
                   "1: run every group eagerly (no mx.compile); or a list of general,prefill,decode: "
                   "those compiled paths off"),
    "trace": (("ORTMLX_TRACE",), "path.json: write a Chrome/Perfetto trace of the session"),
    "verbose": (("ORTMLX_VERBOSE",), "1: print a session summary (groups, compiled paths, fallbacks) at release"),
    "disable_ops": (("ORTMLX_DISABLE_OPS",), "comma-separated op types never claimed (left to the CPU EP)"),
    "tuning": ((TUNING_ENV,), "developer: key=value,... A/B knobs (ortmlx/tuning.py)"),
}

#: the kill switches of earlier releases: each turns one compiled path off (an alias of no_compile=<path>)
KILL_SWITCHES: dict[str, tuple[str, tuple[str, ...]]] = {
    "no_general_compile": ("general", ("ORTMLX_NO_GENERAL_COMPILE", "MLX_EP_NO_GENERAL_COMPILE",
                                       "ONNXRUNTIME_EP_MLX_NO_GENERAL_COMPILE")),
    "no_prefill_compile": ("prefill", ("ORTMLX_NO_PREFILL_COMPILE", "MLX_EP_NO_PREFILL_COMPILE",
                                       "ONNXRUNTIME_EP_MLX_NO_PREFILL_COMPILE")),
    "no_decode_compile": ("decode", ("ORTMLX_NO_DECODE_COMPILE", "ONNXRUNTIME_EP_MLX_NO_DECODE_COMPILE")),
}

#: environment variables of tuning knobs that ORTMLX_TUNING now carries (read no more: one warning)
RETIRED_ENV = {
    "ORTMLX_NO_KV_MIRROR": "ORTMLX_TUNING=kv_mirror=0",
    "ORTMLX_NO_KV_BATCH": "ORTMLX_TUNING=kv_batch=0",
    "ORTMLX_DRIVER_READ": "ORTMLX_TUNING=driver_read=0",
    "ORTMLX_DEVICE_CONSTANTS": "ORTMLX_TUNING=device_constants=0",
    "ORTMLX_CUDA_KERNELS": "ORTMLX_TUNING=cuda_kernels=0",
    "ORTMLX_PINNED_HINTS": "ORTMLX_TUNING=pinned_hints=0",
    "ORTMLX_FOLD_MLP": "ORTMLX_TUNING=fold_mlp=0",
    "ORTMLX_FUSE_ROWS": "ORTMLX_TUNING=fuse_rows=0",
    "ORTMLX_GATED_ROWS": "ORTMLX_TUNING=gated_rows=0",
    "ORTMLX_LIFT_WEIGHTS": "ORTMLX_TUNING=lift_weights=0",
    "ORTMLX_WIDEN_WEIGHTS": "ORTMLX_TUNING=widen_weights=0",
    "ORTMLX_DENSE_NBITS": "ORTMLX_TUNING=dense_nbits=0",
    "ORTMLX_COMPILE_MODE": "ORTMLX_TUNING=compile_mode=no_fuse",
    "ORTMLX_EVAL_SETTLE": "ORTMLX_TUNING=eval_settle=0",
    "ORTMLX_SPIN_WAIT": "ORTMLX_TUNING=spin_wait=0",
    "ORTMLX_HOIST_CLOSED_FORM": "ORTMLX_TUNING=hoist_closed_form=0",
    "ORTMLX_CALL_AHEAD": "ORTMLX_TUNING=call_ahead=1",
    "ORTMLX_FAULT": "ORTMLX_TUNING=fault=compute",
    "ORTMLX_BLAS": "ORTMLX_TUNING=blas=0",
    "ORTMLX_BLAS_THREADS": "ORTMLX_TUNING=blas_threads=2",
    "ORTMLX_GPU_DECODE_COMPILE": "ORTMLX_NO_COMPILE=decode",
}
_warned: set[str] = set()


class OptionError(UserError):
    """A bad provider option or environment variable (one line: the option, its value, the valid values)."""


def switch(name: str, value: str | None) -> bool:
    """An on/off value: 1/true/on/yes or 0/false/off/no/empty; anything else is an ``OptionError``."""
    v = (value or "").strip().lower()
    if v in SWITCH_TRUE:
        return True
    if v in SWITCH_FALSE:
        return False
    raise OptionError(f"option {name}={value!r}: valid values are 1, true, on, yes or 0, false, off, no, empty")


def flag(value: str | None) -> bool:
    """A lenient on/off reading (anything but 0/false/off/no/empty is on), for scripts' own variables."""
    return value is not None and value.strip().lower() not in SWITCH_FALSE


@dataclass(frozen=True)
class EpOptions:
    device: str = "auto"
    #: compiled paths turned off (a subset of COMPILE_PATHS)
    no_compile: frozenset = frozenset()
    trace: str = ""
    verbose: bool = False
    disable_ops: frozenset = field(default_factory=frozenset)
    tuning: Tuning = field(default_factory=Tuning)
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_sources(cls, provider: dict[str, str], env: dict[str, str] | None = None,
                     known_ops: frozenset | None = None) -> "EpOptions":
        """Options from provider options (``provider``) over the environment (``env``); ``known_ops``: the op
        types ``disable_ops`` may name (default: every op type the registry has a translator for)."""
        env = os.environ if env is None else env
        unknown = sorted(set(provider) - set(SPEC) - set(KILL_SWITCHES))
        if unknown:
            key = unknown[0]
            hint = " (a tuning knob: tuning=\"" + key + "=...\")" if key in _TUNING_KEYS else _close(key, SPEC)
            raise OptionError(f"unknown option {key!r}{hint}; options: {', '.join(SPEC)}")
        _warn_retired(env)

        def pick(key: str) -> str | None:
            if key in provider and provider[key] is not None:
                return provider[key]
            names = SPEC[key][0] if key in SPEC else KILL_SWITCHES[key][1]
            return next((env[e] for e in names if env.get(e) is not None), None)

        vals: dict = {}
        dev = (pick("device") or "").strip().lower() or "auto"
        if dev not in DEVICES:
            raise OptionError(f"option device={dev!r}: valid values are {', '.join(DEVICES)}")
        vals["device"] = dev
        off = set(_paths(pick("no_compile")))
        for key, (path, _) in KILL_SWITCHES.items():
            if switch(key, pick(key)):
                off.add(path)
        vals["no_compile"] = frozenset(off)
        vals["trace"] = (pick("trace") or "").strip()
        vals["verbose"] = switch("verbose", pick("verbose"))
        ops = frozenset(o.strip() for o in (pick("disable_ops") or "").split(",") if o.strip())
        if ops:
            known = _known_ops() if known_ops is None else known_ops
            bad = sorted(ops - known)
            if bad:
                raise OptionError(f"option disable_ops: {bad[0]!r} is not an op type the MLX EP runs"
                                  f"{_close(bad[0], known)} (list: docs/operators.md)")
        vals["disable_ops"] = ops
        base = Tuning.parse(env.get(TUNING_ENV), where=TUNING_ENV)
        process_wide = [k for k in tuning_keys(provider.get("tuning")) if k in ENV_ONLY]
        if process_wide:
            raise OptionError(f"option tuning: {process_wide[0]!r} is process-wide, read from the environment only: "
                              f"set it in {TUNING_ENV}")
        vals["tuning"] = Tuning.parse(provider.get("tuning"), base, where="option tuning")
        return cls(**vals, raw=dict(provider))

    @classmethod
    def from_session_config(cls, config: dict[str, str]) -> "EpOptions":
        return cls.from_sources({k[len(PREFIX):]: v for k, v in config.items() if k.startswith(PREFIX)})

    @property
    def compile_enabled(self) -> bool:
        """Whether any group may be compiled."""
        return set(COMPILE_PATHS) - self.no_compile != set() and self.tuning.compile_mode != "disabled"

    def compiles(self, path: str) -> bool:
        """Whether the compiled ``path`` (general / prefill / decode) is on."""
        return path not in self.no_compile and self.tuning.compile_mode != "disabled"


_TUNING_KEYS = frozenset(Tuning.__dataclass_fields__)


def _paths(value: str | None) -> list[str]:
    """``no_compile``'s value as compiled paths: a switch (1: all of them) or a list of path names."""
    v = (value or "").strip().lower()
    if v in SWITCH_FALSE:
        return []
    if v in SWITCH_TRUE or v == "all":
        return list(COMPILE_PATHS)
    parts = [p.strip() for p in v.split(",") if p.strip()]
    bad = [p for p in parts if p not in COMPILE_PATHS]
    if bad:
        raise OptionError(f"option no_compile={value!r}: valid values are 1 (all), 0, or a list of "
                          f"{', '.join(COMPILE_PATHS)}")
    return parts


def _close(word: str, choices) -> str:
    m = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


def _known_ops() -> frozenset:
    return frozenset(REGISTRY.op_types(None))


def _warn_retired(env) -> None:
    for name, knob in RETIRED_ENV.items():
        if env.get(name) is not None and name not in _warned:
            _warned.add(name)
            warnings.warn(f"{name} is no longer read: use {knob} (docs/performance.md)",
                          RuntimeWarning, stacklevel=3)


def option_names() -> list[str]:
    return list(SPEC)

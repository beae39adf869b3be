"""``CompiledSubgraph``: trace a whole group into an ``mx.compile`` closure, verify, replay.

Per call: key the inputs (shapes, or ranks for shapeless), find the closure for
the key, and replay it once it is trusted. A closure is trusted only after its
outputs matched eager on its first call (and, shapeless or padded, again at a second,
different shape, for the first such closure of this subgraph: every later one traces the same
body, so its first match trusts it); until then the call answers from eager. Any error or mismatch
poisons the closure (dropped, never called again) and the call answers from eager.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import operator
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from ..kernels import background, build, cuda_driver, cuda_kernels
from ..kernels import dtypes as dt
from ..kernels.interpreter import mx_device
from ..kernels.ops.reduction import reduce_sum_ints_host
from ..tuning import Tuning
from ..version import mlx_cache_dir
from . import ahead, hoist_form, replay
from .analysis import HostPlan, constant_if, hoist_free_work, host_plan, keyed_shapes, static_reason
from .config import CompiledConfig
from .keys import Keys, is_empty, shapes_of
from .trace import compile_closure
from .result import Prebuild, RowHints, RunResult, Steady
from .verify import mismatch

#: what ``_apply`` returns when a guard computed in the graph said "not this call"
GUARD_FAILED = object()
#: row hints' bytes from which a call reads them in its closure's host buffer rather than a copy of its own
#: (a prompt's rows: 50 MB at 4,096 tokens of a 0.5B model, whose copy into fresh memory cost milliseconds)
HINT_BORROW_MIN = 1 << 20
#: keys remembered while they wait for their trace (``CompiledConfig.eager_calls_before_trace``)
SEEN_KEYS = 256
#: a closure's first call longer than this (seconds) is said on the console, once per process
BUILD_NOTICE_S = 1.0
_NOTICED: list = []
#: a closure's first call still running after this many seconds says so while it runs, once per process (a host's
#: first run builds every kernel: a minute or more on a GPU, with nothing else on the console)
HEADS_UP_S = 3.0
_HEADS_UP: list = []
#: MLX's trace state is process-global: one trace at a time (re-entrant for nested groups)
TRACE_LOCK = threading.RLock()


def compile_thread() -> bool:
    """Whether closures may run on this thread: only the main thread.

    MLX's compile cache is thread-local and its entries hold Python objects; a thread that
    exits destroys its cache in C++ thread-local destructors, after its Python thread state
    is gone. On ORT's native pool threads (ORT_PARALLEL) that deadlocked session release;
    on Python worker threads it aborted the process ("terminate called without an active
    exception") in about 1 of 20 runs under load. Every other thread runs eagerly.
    """
    return threading.current_thread() is threading.main_thread()


def tracing() -> bool:
    """True while this thread is inside a compiled closure's traced body."""
    return build.tracing()


class Call:
    """One call as a closure sees it: its inputs (maybe padded), the shapes that verify it
    (the real ones), ``post`` mapping the closure's host outputs to the call's, and ``standins``: the
    inputs given as zeros in place of values the closure does not read (``RunResult.standins``)."""

    __slots__ = ("inputs", "sig", "post", "padded", "standins")

    def __init__(self, inputs: list, sig: tuple, post=None, padded: bool = False, standins: frozenset = frozenset()):
        self.inputs = inputs
        self.sig = sig
        self.post = post
        self.padded = padded
        self.standins = standins


class _Closure:
    """One compiled closure for one key: its inputs split, its counters and state."""

    __slots__ = ("fn", "dev_idx", "pick", "dev_kinds", "dev_up", "host_vals", "traces", "calls", "verified",
                 "trusted", "poisoned",
                 "guard_fails", "hoist", "hoist_prog", "trace_prog", "shapeless", "hints", "hint_starts", "sink",
                 "host_outs", "hint_at", "sink_layout", "hoist_run", "ahead_kinds", "ahead_misses", "ahead_hv",
                 "behind", "keyed", "interim", "outputs", "guard_only", "guard_count", "replay", "stand_in")

    def __init__(self, dev_idx: tuple[int, ...], host_vals: dict[int, np.ndarray | None]):
        self.fn = None
        self.dev_idx = dev_idx
        self.pick = picker(dev_idx)     # the device inputs of a call's inputs, as a tuple
        self.dev_kinds: tuple | None = None     # their types in the last call, and which of them were host arrays
        self.dev_up: list = []
        self.host_vals = host_vals
        self.hoist: tuple[str, ...] = ()     # values computed per call (hoist_prog) and fed as data
        self.hoist_prog = None
        self.hoist_run = None           # hoist_prog's NumPy-only runner (``Program.host_runner``), if it has one
        self.trace_prog = None
        self.traces = 0
        self.calls = 0
        self.verified: set = set()
        self.trusted = False
        self.poisoned: str | None = None
        #: the shapes of the values the plan baked as the key's (``HostPlan.keyed``), at the call that traced
        self.keyed: dict[str, tuple] = {}
        self.guard_fails = 0
        self.shapeless = False          # traced with mx.compile(shapeless=True)
        #: row hints of the trace: [(output j, input i, row shape, item size)]; their rows and starts are one
        #: extra output before the guard (set while tracing)
        self.hints: list = []
        self.hint_starts = np.zeros(0, np.intp)     # per hint batch row: its start among the distinct ones
        #: page-locked host memory the hints' kernel writes (``pinned_hints``; made at the first trace)
        self.sink: cuda_driver.HostBuffer | None = None
        #: outputs its kernels write to ``sink``: [(output j, first byte, end, shape, NumPy type)] (set while tracing)
        self.host_outs: list = []
        self.hint_at = 0                # where in ``sink`` the hints' bytes start (after the outputs')
        #: the sink's layout at the first trace (hints, their starts, host outputs, guard): a retrace (new input
        #: shapes) shares the sink and the reading of it, so it must lay the bytes out the same
        self.sink_layout: tuple | None = None
        #: calls made ahead (``ahead.py``): per device input, what the next call passes (None: not learnt);
        #: made-ahead graphs in a row that did not fit; the last call's hoisted host values
        self.ahead_kinds: tuple | None = None
        self.ahead_misses = 0
        self.ahead_hv: list | None = None
        #: the ``kernels/background.py`` key of the build of its kernels behind the calls (None: none queued)
        self.behind: str | None = None
        #: meanwhile, its program traced without fusion (``CompiledSubgraph._interim``; None: not made)
        self.interim: "_Closure | None" = None
        #: the traced body's outputs built from given inputs (``trace.compile_closure``; eagerly: a recorded step)
        self.outputs = None
        #: the same body's guard alone, built with MLX's ops only (``trace.compile_closure``), and how many guards
        #: the closure's own trace made (set while tracing: ``guarded``)
        self.guard_only = None
        self.guard_count = 0
        #: its step recorded and replayed as one CUDA graph (``replay.StepReplay``; None: not asked for)
        self.replay = None
        #: an interim closure (``shadow``): answers only while the fused one's kernels are built elsewhere, so
        #: it records no replay (the recording's kernels would be built here, stalling those calls)
        self.stand_in = False

    @property
    def guarded(self) -> bool:
        """Whether the last output is a guard (its trace made one or more)."""
        return self.guard_count > 0

    def shadow(self) -> "_Closure":
        """A closure of the same program and inputs with fresh trace state: traced on the kernel builder's
        thread, its kernels are this one's (MLX names a kernel by its graph), its state never touches this."""
        s = _Closure(self.dev_idx, self.host_vals)
        s.hoist, s.hoist_prog, s.hoist_run = self.hoist, self.hoist_prog, self.hoist_run
        s.trace_prog, s.shapeless, s.keyed = self.trace_prog, self.shapeless, self.keyed
        s.stand_in = True
        return s


class CompiledSubgraph:
    """The runner Compute calls: compiled replay with an eager answer on any doubt."""

    def __init__(self, program, config: CompiledConfig, stats=None, overrides: dict | None = None,
                 free_dims: frozenset | None = None, label: str | None = None, tuning: Tuning | None = None):
        self.program = program
        self.config = config
        #: the developer knobs this runner reads (``ortmlx/tuning.py``): eval_settle, spin_wait,
        #: hoist_closed_form, call_ahead, gpu_shapeless
        self.tuning = tuning = tuning or Tuning()
        self.stats = stats
        self.name = program.graph.name
        self.label = label or config.name
        #: the program the traces build: steps whose translator is replaced by a traced form
        self.trace_program = with_overrides(program, overrides or {})
        #: the calls' shape keys (``keys.py``)
        self.keys = Keys(len(program.inputs), config.shapeless, free_dims)
        self.device = program.device
        self._mx_device = mx_device(self.device)
        self.static_reason = static_reason(program)
        self._in_types = [program.types.get(n) for n in program.inputs]
        self._out_types = [program.types.get(n) for n in program.outputs]
        self._bf16 = frozenset(j for j, t in enumerate(self._out_types) if t == dt.BFLOAT16)
        self._plans: dict = {}              # key1 -> HostPlan | str (why not)
        self._closures: dict = {}           # full key -> _Closure
        self._seen: dict = {}               # key1 -> eager calls made before its trace
        self._lock = threading.Lock()
        self._said: set[str] = set()
        self.released = False
        self._stopped = False               # no new keys any more (max_keys / thrashing)
        #: a shapeless or padded closure matched eager at two shapes: the body reads its lengths, not a baked one
        self._proven = False
        self._eval = mx.eval                # the compiled path's eval (tests inject failures here)
        #: ``run``'s last lookup: (k1, its plan, host bytes, closure); an identical k1 object finds them again
        #: (``Keys.since`` keeps the object while no part changes; only ``_first`` and ``release`` change the maps)
        self._last: tuple | None = None
        #: (plan, host bytes, closure) when the last call was answered by a closure (``steady``), else None
        self._answered: tuple | None = None
        self._plain_prepare = type(self)._prepare is CompiledSubgraph._prepare
        # on a GPU, start the eval asynchronously and make one 4 KB allocation while the GPU runs: the first such
        # allocation after MLX frees an evaluated graph consolidates glibc's fastbins, which the copy-out's first
        # allocation paid after the wait otherwise (docs/performance.md)
        self._settle = tuning.eval_settle and self.device == "gpu"
        #: a new closure's kernels built on the kernel builder's thread while its key's calls answer eagerly (MLX's
        #: CPU backend: g++; on MLX 0.32.4's CUDA backend such a thread starved while the main one evaluated), where
        #: no worker process builds them (``self.prebuild``)
        self._behind = tuning.build_behind and self.device == "cpu"
        #: MLX's kernel fusion in this runner's traces: off for a prompt's on a GPU (tuning prompt_fuse), where its
        #: fused kernels were most of a new host's compiled first token and no faster warm (docs/performance.md)
        fuse = tuning.prompt_fuse if tuning.prompt_fuse is not None else self.device != "gpu"
        self._fuse = fuse or config.name != "prefill"
        #: where a new closure's kernels are built in another process meanwhile (``Prebuild``; set by
        #: ``make_runner`` for a GPU's groups: there the builder thread starved)
        self.prebuild: Prebuild | None = None
        # MLX waits on blocking-sync CUDA events (the thread sleeps until an interrupt); polling the context first
        # finds the work done on a hot core
        self._spin = _spin_waiter() if self._settle and tuning.spin_wait else None
        #: calls made ahead (``ahead.py``): whether, the one made for the next call, (closure, results) of the last;
        #: by default where the eval is started asynchronously (a GPU)
        self._ahead = tuning.call_ahead if tuning.call_ahead is not None else self._settle
        self._next: ahead.Ahead | None = None
        self._ahead_prev: tuple | None = None
        #: a trusted decode closure's steps recorded and replayed as one CUDA graph (``replay.py``; tuning replay)
        self._replay_on = tuning.replay and self.device == "gpu" and config.name == "decode" and \
            program.cuda_kernels and cuda_kernels.usable()
        self.counters = {"compiled": self.label, "traces": 0, "compiled_calls": 0, "eager_calls": 0,
                         "verify_calls": 0, "guard_fails": 0, "poisoned": "", "poisoned_closures": 0, "keys": 0,
                         "trace_ms": 0.0, "build_s": 0.0, "ahead_calls": 0, "ahead_misses": 0}
        if self._replay_on:
            self.counters.update(replayed_calls=0, replay="")
        if stats is not None:
            g = stats.group(self.name)
            if label is None:
                g.update(self.counters)
                self.counters = g
            else:
                g[label] = self.counters
        if self.static_reason:
            self._fallback(self.static_reason)

    # ------------------------------------------------------------------ public
    def run(self, inputs: list, probe=None, since: tuple | None = None) -> RunResult:
        """Outputs for ``inputs``: compiled when trusted, else eager (same answer).

        ``since``: (the previous gather's number, this one's, the inputs whose shape or type may differ from that
        gather's), from Compute (``ep.compute.ComputeInfo.gather``): the key is worked out for those only."""
        out = self._run(inputs, probe, since)
        return out if type(out) is RunResult else RunResult(out)

    def _run(self, inputs: list, probe, since: tuple | None) -> "list | RunResult":
        self._answered = None
        with mx.stream(self._mx_device):
            if self.released or self.static_reason:
                return self._eager(inputs, probe)
            if not compile_thread():
                self._fallback("called off the main thread (MLX's per-thread compile cache would be torn "
                               "down without the GIL when the thread exits): eager")
                return self._eager(inputs, probe)
            keyed_since = since is not None and self._plain_prepare
            if self.device == "gpu" and not keyed_since and any(map(is_empty, inputs)):
                return self._eager(inputs, probe)      # MLX's CUDA compiled kernels crash (SIGFPE) on size 0
            try:
                if keyed_since:
                    sig, k1, empty = self.keys.since(inputs, since)
                    call = Call(inputs, sig)
                    if empty and self.device == "gpu":
                        return self._eager(inputs, probe)       # (as above)
                else:
                    call = self._prepare(inputs)
                    if call is None:
                        return self._eager(inputs, probe)
                    k1 = self.keys.key(call.inputs, None if call.padded else call.sig)
            except Exception as e:  # noqa: BLE001 - an input we cannot key runs eagerly
                self._fallback(f"cannot key inputs: {type(e).__name__}: {e}")
                return self._eager(inputs, probe)
            last = self._last              # (k1, its plan, host bytes, closure) of the last closure found
            same = last is not None and last[0] is k1
            plan = last[1] if same else self._plans.get(k1)
            if plan is None:
                if self._stopped or self._not_yet(k1):
                    return self._eager(inputs, probe)
                return self._first(k1, inputs, call, probe)
            if isinstance(plan, str):
                return self._eager(inputs, probe)
            hb = _host_bytes(plan, call.inputs)
            c = last[3] if same and last[2] == hb else self._closures.get((k1, hb))
            if c is None:
                if self._stopped:
                    return self._eager(inputs, probe)
                return self._first(k1, inputs, call, probe, plan)
            self._last = (k1, plan, hb, c)
            got = self._answer(c, call, inputs, probe)
            if got is not None:
                if got[1]:
                    self._answered = (plan, hb, c)
                return got[0]
            if c.behind is not None:
                st = background.state(c.behind)
                if st == background.QUEUED:
                    return self._interim(c, call, inputs, probe)        # its kernels are still being built
                if st != background.DONE:   # (the verification below builds them here; the summary says why)
                    self._fallback(f"kernels built behind the calls: {st}")
                c.behind = None
            return self._verify_call(c, call, inputs, probe)

    def _verify_call(self, c: _Closure, call: "Call", inputs: list, probe) -> list:
        """This call's eager answer, ``c`` verified against it (poisoned instead where a declared shape the plan
        took as the key's has changed: baked wrong)."""
        ref, env = self._eager_env(inputs, probe)
        moved = [n for n, shape in c.keyed.items() if np.shape(env[n]) != shape]
        if moved:
            self._poison(c, f"{moved[0]}'s shape {np.shape(env[moved[0]])} changed under one key "
                            f"(traced at {c.keyed[moved[0]]}; its declared dims are the key's)")
            return ref
        self._verify(c, call, ref)
        return ref

    def steady(self, inputs: list) -> Steady | None:
        """The last call's closure as a replay (``Steady``) when it alone answers calls of these input shapes and
        types: trusted, nothing read or baked on the host, no guards, hints or padding, every input a host array
        (so no call is made ahead: nothing chains from call to call, ``ahead.learn``)."""
        last = self._answered
        if last is None or self.released or self.config.shapeless or not self._plain_prepare:
            return None
        plan, hb, c = last
        if hb or plan.host_inputs or plan.host_outputs or plan.hoist or not c.trusted or c.poisoned or c.guarded \
                or c.hoist or c.hints or c.sink is not None or c.host_outs or c.fn is None:
            return None
        types = []
        for i in c.dev_idx:
            a, t = inputs[i], self._in_types[i]
            if type(a) is not np.ndarray or not a.size or t is None or t in dt.CARRIERS or t not in dt.MLX:
                return None
            types.append(t)
        if any(a is not None and type(a) is not np.ndarray for a in inputs):
            return None
        return Steady(tuple(None if a is None else a.shape for a in inputs),
                      tuple(None if a is None else a.dtype for a in inputs), c.dev_idx, tuple(types), c)

    def replay(self, steady: Steady, inputs: list) -> RunResult | None:
        """``steady``'s closure on ``inputs`` (None: it was poisoned or released, or failed now and is poisoned)."""
        c = steady.closure
        if c.fn is None or c.poisoned or self.released:
            return None
        self._next = self._ahead_prev = None
        with mx.stream(self._mx_device):
            try:
                up = self.program.upload
                dev = [up(inputs[i], t) for i, t in zip(steady.idx, steady.types)]
                with TRACE_LOCK:
                    outs = c.fn(*dev)
                self._settled_eval(outs)
            except Exception as e:  # noqa: BLE001 - poisoned; the call answers through ``run`` (eager)
                self._poison(c, f"apply: {type(e).__name__}: {e}")
                return None
        c.calls += 1
        self.counters["compiled_calls"] += 1
        return RunResult(list(outs), source=c, replayed=True)

    def _settled_eval(self, outs, meanwhile=None) -> None:
        """Evaluate ``outs``; on a GPU started asynchronously, the heap settled and ``meanwhile()`` run while it
        works, then its end polled (``eval_settle``, ``spin_wait``)."""
        if self._settle or meanwhile is not None:
            mx.async_eval(*outs)
            if self._settle:
                bytearray(4096)             # the heap's consolidation, while the GPU works
            if meanwhile is not None:
                meanwhile()
            if self._spin is not None:
                self._spin()                # the GPU's work done, polled (MLX's wait below finds it so)
        self._eval(*outs)

    def _not_yet(self, k1) -> bool:
        """Whether key ``k1`` is still answered eagerly before its trace (``eager_calls_before_trace``)."""
        wait = self.config.eager_calls_before_trace
        if wait <= 0:
            return False
        n = self._seen.get(k1, 0)
        if n >= wait:
            return False
        if len(self._seen) >= SEEN_KEYS:
            self._seen.clear()          # shapes that never repeat: forget them
        self._seen[k1] = n + 1
        return True

    def _prepare(self, inputs: list) -> "Call | None":
        """What the closure runs on for this call (None: this call runs eagerly)."""
        return Call(inputs, shapes_of(inputs))

    def parts(self) -> list["CompiledSubgraph"]:
        return [self]

    def closures(self) -> list[_Closure]:
        return list(self._closures.values())

    def trace_counts(self) -> list[int]:
        """Traces per closure, in key order."""
        return [c.traces for c in self._closures.values()]

    def release(self) -> None:
        """Drop every closure (a live closure at interpreter exit can abort the process)."""
        self.released = True
        self._last = self._answered = None
        self._next = self._ahead_prev = None
        with self._lock:
            for c in self._closures.values():
                c.fn = None
                if c.interim is not None:
                    c.interim.fn = None
                if c.replay is not None:
                    c.replay.release()
            self._closures.clear()
            self._plans.clear()
            self._seen.clear()

    # ------------------------------------------------------------------ steps
    def _first(self, k1, inputs: list, call: "Call", probe, plan: HostPlan | None = None) -> list:
        """First call for a key: eager answer, host analysis, trace and verify."""
        self._last = None               # (plans and closures change below)
        ref, env = self._eager_env(inputs, probe)
        if self.device == "gpu" and any(isinstance(v, mx.array) and v.size == 0 for v in env.values()):
            # a compiled kernel over a zero-size value kills the process on MLX's CUDA backend (SIGFPE,
            # measured on 0.32.4): this key stays eager
            self._plans[k1] = "zero-size values in the group (MLX CUDA compiled kernels crash on them)"
            self._fallback(self._plans[k1])
            return ref
        try:
            keyed = keyed_shapes(self.trace_program, self.keys.free_dims) \
                if self.config.shapeless and self.keys.free_dims is not None else None
            new = host_plan(self.trace_program, env, hoist=self.config.shapeless, keyed=keyed)
            if self.config.shapeless and not new.shapeless_reason():
                new = hoist_free_work(self.trace_program, env, new, self.keys.free_inputs())
        except Exception as e:  # noqa: BLE001
            new = HostPlan(frozenset(), (), frozenset(), f"host analysis failed: {type(e).__name__}: {e}")
        reason = new.shapeless_reason() if self.config.shapeless else new.reason
        if plan is not None and not reason and new.host_inputs != plan.host_inputs:
            reason = "which inputs are read on the host depends on their values"
        if reason:
            self._plans[k1] = reason
            self._fallback(reason)
            return ref
        self._plans[k1] = new
        key = (k1, _host_bytes(new, call.inputs))
        with self._lock:
            if key in self._closures:
                return ref                  # another thread made it meanwhile
            if len(self._closures) >= self.config.max_keys:
                self._stopped = True
                self._fallback(f"more than {self.config.max_keys} shape keys: new keys run eagerly")
                return ref
            if len(self._closures) >= self.config.thrash_keys and self.counters["compiled_calls"] == 0:
                self._stopped = True
                self._fallback(f"{len(self._closures)} shape keys and no closure reused: shapes change "
                               "every call, new keys run eagerly")
                return ref
            self._closures[key] = c = self._new_closure(new, call.inputs)
            c.keyed = {n: np.shape(env[n]) for n in new.keyed}
            self.counters["keys"] = len(self._closures)
        if c.fn is not None and not (self._prebuilt(c, key) if self.prebuild is not None
                                     else self._behind and self._build_behind(c, call)):
            self._verify(c, call, ref)
            self._verify_another(c, key, new, call, inputs)
        return ref

    def _another_length(self, inputs: list) -> list | None:
        """This call's inputs at another valid length of the same padded key (None: none such)."""
        return None

    def _verify_another(self, c: _Closure, key: tuple, plan: HostPlan, call: "Call", inputs: list) -> None:
        """After a padded closure's first match in the call that traced it (``key``: its key, ``plan`` its host plan),
        its second at another valid length of the same key (``_another_length``), in that call rather than at the
        key's next one, which would pay an eager answer and the closure's run (docs/compiled.md). Not in a later
        verifying call (a closure whose kernels were built elsewhere meanwhile): that would double a user's call to
        spare another. The user's answer is this call's eager one; nothing of the other length's leaves here (the
        closure's results, its host buffer's rows among them, are dropped)."""
        if not call.padded or c.trusted or c.poisoned or len(c.verified) != 1:
            return
        try:
            other = self._another_length(inputs)
            again = self._prepare(other) if other is not None else None
            if again is None or not again.padded \
                    or (self.keys.key(again.inputs, None), _host_bytes(plan, again.inputs)) != key:
                return
            ref, _ = self._eager_env(other, None)
        except Exception:  # noqa: BLE001 - the other length's eager answer failed: the key's next call verifies
            return
        self._verify(c, again, ref)
        self._next = self._ahead_prev = None        # (nothing made ahead from a call no one made)

    def _interim(self, c: _Closure, call: "Call", inputs: list, probe) -> "list | RunResult":
        """A call of ``c``'s key while its fused kernels are built elsewhere: ``c``'s program traced without MLX's
        fusion (its kernels MLX's own, prebuilt, and ours) answers once verified as any closure; eager where it
        fails or this runner does not fuse (``c`` itself is then unfused: nothing to wait for but MLX's JIT)."""
        u = c.interim
        if u is None:
            if not (self.tuning.interim and self._fuse):
                return self._eager(inputs, probe)
            u = c.interim = c.shadow()
            try:
                u.fn = compile_closure(u, len(self.program.inputs), self._out_types, self.config, self.counters,
                                       self.stats, self.name, False)
            except Exception as e:  # noqa: BLE001
                u.poisoned = f"compile: {type(e).__name__}: {e}"
        got = self._answer(u, call, inputs, probe)
        if got is None:
            return self._verify_call(u, call, inputs, probe)
        if got[1]:
            self.counters["interim_calls"] = self.counters.get("interim_calls", 0) + 1
        return got[0]

    def _answer(self, c: _Closure, call: "Call", inputs: list, probe) -> "tuple[list | RunResult, bool] | None":
        """(The call's answer, whether ``c`` gave it) where ``c`` may answer: trusted or verified at these shapes
        (eager instead when its call fails a guard or poisons it), or poisoned (eager); None: verify it first."""
        if c.poisoned:
            return self._eager(inputs, probe), False
        if not (c.trusted or call.sig in c.verified):
            return None
        out = self._apply(c, call, probe)
        if out is None or out is GUARD_FAILED:
            return self._eager(inputs, probe), False
        self.counters["compiled_calls"] += 1
        return out, True

    def _prebuilt(self, c: _Closure, key: tuple) -> bool:
        """Whether ``c``'s kernels are being built in another process (``self.prebuild``), its key's calls
        answered without them until they are (``_interim``); False: trace it here now."""
        if self.prebuild is None:
            return False
        # with the replay on, the worker's calls also record, check and serve it (its guard's kernels built there)
        c.behind = self.prebuild.submit(self.label, f"{self.name} {key!r}",
                                        replay.WARM_CALLS if self._replay_on else None)
        if c.behind is None:
            return False
        self.counters["built_behind"] = self.counters.get("built_behind", 0) + 1
        return True

    def _build_behind(self, c: _Closure, call: "Call") -> bool:
        """Queue a build of ``c``'s kernels on the kernel builder's thread (``kernels/background.py``): a shadow of
        ``c`` traced and evaluated there on this call's inputs, so that ``c``'s own trace on this thread, at a
        later call of its key, finds them built; until then its calls answer eagerly. False: not queued."""
        try:
            host = list(c.pick(call.inputs))
            dev = self._upload(c, host)
            if c.hoist:
                dev.extend(self._upload_hoisted(c, self._hoisted_values(c, call.inputs)))
        except Exception:  # noqa: BLE001 - the verification here says what fails
            return False
        shadow, n_in, out_types, config, fuse = c.shadow(), len(self.program.inputs), self._out_types, self.config, \
            self._fuse

        def build_kernels():
            with mx.stream(mx.cpu):
                fn = compile_closure(shadow, n_in, out_types, config, collections.defaultdict(int), None, "", fuse)
                with TRACE_LOCK:
                    outs = fn(*dev)
                mx.eval(*outs)
        c.behind = f"closure {id(c)} {time.perf_counter_ns()}"
        background.submit(c.behind, build_kernels)
        self.counters["built_behind"] = self.counters.get("built_behind", 0) + 1
        return True

    def _traces_free_dims(self, c: _Closure) -> bool:
        """Whether a closure of a shapeless key sees a shape that varies between calls: a traced
        group input with a free dim. When none does (genai's decode once the growing attention
        mask is hoisted out), the closure is traced shape-keyed instead: MLX retraces on any new
        input shape (hoisted values included), so nothing baked from a shape can go stale, and
        slices, ``split`` and ``mx.fast`` kernels are allowed. More than ``trace.MAX_FIXED_TRACES``
        traces (shapes did vary) poisons it: that key runs eagerly."""
        free = self.keys.free_inputs()
        return any(i in free for i in c.dev_idx)

    def _new_closure(self, plan: HostPlan, inputs: list) -> _Closure:
        """A closure for one key: device inputs are traced, the others baked in (copied)."""
        trace_prog, unread = self.trace_program, frozenset()
        if plan.hoist:
            keep = [k for k in range(len(self.trace_program.steps)) if k not in plan.hoist_steps]
            trace_prog = sub_program(self.trace_program, keep, self.program.inputs + list(plan.hoist),
                                     self.program.outputs)
            # inputs only the hoisted work reads (the growing mask) are not passed to the trace
            read = {n for st in trace_prog.steps for n in st.inputs if n} | set(self.program.outputs)
            unread = frozenset(i for i, n in enumerate(self.program.inputs) if n not in read)
        dev_idx = tuple(i for i, a in enumerate(inputs)
                        if a is not None and i not in plan.host_inputs and i not in unread)
        host_vals = {i: (None if a is None or i in unread else np.array(a, copy=True))
                     for i, a in enumerate(inputs) if i not in dev_idx}
        c = _Closure(dev_idx, host_vals)
        c.trace_prog = trace_prog
        if plan.hoist:
            c.hoist = plan.hoist
            c.hoist_prog = sub_program(self.program, plan.hoist_steps, self.program.inputs, plan.hoist)
            c.hoist_run = c.hoist_prog.host_runner(_HOIST_HOST)
            fast = hoist_form.closed_form(c.hoist_prog) if c.hoist_run is not None and self.tuning.hoist_closed_form \
                else None
            if fast is not None:
                c.hoist_run = hoist_form.checked(fast, c.hoist_run, c.hoist, self._fallback)
        c.shapeless = self.config.shapeless and self._traces_free_dims(c)
        if c.shapeless and any(constant_if(self.trace_program.steps[k]) for k in plan.hoist_steps):
            # its branches' outputs may differ in shape, which a shapeless trace would not see
            c.poisoned = "an If hoisted out of a shapeless trace (the shapes of its outputs are not in the key)"
            self._fallback(c.poisoned)
            return c
        if c.shapeless and self.device == "gpu" and not self.tuning.gpu_shapeless:
            c.poisoned = ("a shapeless closure on a GPU runs eagerly (MLX 0.32.4's CUDA backend ran them ~3x slower "
                          "than eager; tuning gpu_shapeless=1 compiles them; docs/compiled.md)")
            self._fallback(c.poisoned)
            return c
        try:
            c.fn = compile_closure(c, len(self.program.inputs), self._out_types, self.config, self.counters, self.stats,
                                   self.name, self._fuse)
        except Exception as e:  # noqa: BLE001
            c.poisoned = f"compile: {type(e).__name__}: {e}"
            self._fallback(c.poisoned)
        return c

    def _verify(self, c: _Closure, call: "Call", ref: list) -> None:
        """Run the closure next to an eager answer; trust, or poison on any difference."""
        self.counters["verify_calls"] += 1
        sig = call.sig
        first, t0 = c.calls == 0, time.perf_counter()
        timer = self._heads_up() if first else None
        try:
            got = self._apply(c, call, None)
        finally:
            if timer is not None:
                timer.cancel()
        if first:
            self._built(time.perf_counter() - t0)
        if got is None or got is GUARD_FAILED:
            return
        try:
            why = mismatch(got.outputs, ref, self._bf16,
                           device=mx.gpu if self.device == "gpu" else None)
            if not why and got.row_hints is not None:
                why = _hint_mismatch(got.row_hints, got.outputs)
        except Exception as e:  # noqa: BLE001
            why = f"comparison failed: {type(e).__name__}: {e}"
        if why:
            shapes = list(sig)
            at = shapes if len(shapes) <= 8 else f"{shapes[:8]} and {len(shapes) - 8} more"
            self._poison(c, f"outputs differ from eager: {why} (input shapes {at})")
            return
        c.verified.add(sig)
        if (self.config.shapeless or call.padded) and len(c.verified) >= 2:
            self._proven = True
        c.trusted = not (self.config.shapeless or call.padded) or len(c.verified) >= 2 or self._proven

    def _apply(self, c: _Closure, call: "Call", probe) -> RunResult | None:
        """Host outputs of the closure, or None after poisoning it on any error."""
        stage = "inputs"
        inputs = call.inputs
        nxt, self._next = self._next, None
        prev, self._ahead_prev = self._ahead_prev, None
        try:
            host = list(c.pick(inputs))
            hv = []
            if c.hoist:
                stage = "hoisted values"
                hv = self._hoisted_values(c, inputs)
            rp = c.replay
            if rp is not None and rp.serving() and call.post is None:
                got = self._serve_replay(c, rp, call, host, hv)
                if got is not None:
                    return got
            outs = None
            if nxt is not None:
                outs = ahead.take(nxt, c, host, hv)
                if outs is None:
                    self.counters["ahead_misses"] += 1
                    c.ahead_misses += 1
                    c.ahead_kinds = None        # learnt again from this call
                else:
                    self.counters["ahead_calls"] += 1
                    c.ahead_misses = 0
                    dev = nxt.dev
                del nxt
            if probe is not None:
                probe.mark("build")
            if outs is None:
                stage = "inputs"
                dev = self._upload(c, host)
                if c.hoist:
                    stage = "hoisted values"
                    dev.extend(self._upload_hoisted(c, hv))
                stage = "trace" if c.traces == 0 else "apply"
                t0 = time.perf_counter_ns()
                fn = c.fn
                if fn is None:
                    raise RuntimeError("closure was released")
                with TRACE_LOCK:
                    outs = fn(*dev)
                if stage == "trace":
                    self.counters["trace_ms"] += (time.perf_counter_ns() - t0) / 1e6
            stage = "eval"
            if probe is not None:
                probe.mark("eval")
            meanwhile = None
            if self._ahead and c.trusted and call.post is None and ahead.due(c) and \
                    not (c.replay is not None and c.replay.pending()):     # (its check reads this call's sink)
                def meanwhile():
                    nonlocal stage
                    stage = "call ahead"
                    self._next = self._call_ahead(c, host, dev, hv, outs, prev)
                    stage = "eval"
            self._settled_eval(outs, meanwhile)
            c.calls += 1
            if self._ahead and c.ahead_kinds is None and c.ahead_misses < ahead.MAX_MISSES and c.trusted:
                self._ahead_prev = (c, outs)    # (to learn which of them the next call passes: ``_call_ahead``)
            if c.guarded:
                stage = "guard"
                if not bool(outs[-1].item()):
                    c.guard_fails += 1
                    self.counters["guard_fails"] += 1
                    return GUARD_FAILED
                outs = outs[:-1]
            stage = "post"
            outs = list(outs)           # evaluated MLX arrays: Compute copies them out (maybe only changed rows)
            if c.host_outs:
                # written to host memory by the kernels: read-only views, valid until this closure's next
                # eval (on this, the main thread: ``compile_thread``; a call made ahead is evaluated at the
                # next call), which comes after Compute copied them
                for j, off, end, shape, npt in c.host_outs:
                    v = c.sink.array[off:end].view(npt).reshape(shape)
                    v.flags.writeable = False
                    outs[j] = v
            hints = None
            if c.hints:
                hints = RowHints(c.hints, outs[-1], c.hint_starts)
                if c.sink is not None and outs[-1].size == 1:
                    # the kernel wrote the bytes to host memory; the next call of this closure (on this,
                    # the main thread: ``compile_thread``) rewrites it, so the call keeps a copy, unless the
                    # rows are large (a prompt's) and no call made ahead may write it first: then the copy-out
                    # reads them in place (``RowHints.borrowed``)
                    view = c.sink.array[c.hint_at:c.hint_at + hints.nbytes]
                    if hints.nbytes >= HINT_BORROW_MIN and self._next is None:
                        view.flags.writeable = False
                        hints.data, hints.borrowed = view, True
                    else:
                        hints.data = view.copy()
                outs = outs[:-1]
            if call.post is not None:
                outs = call.post(outs)
            elif self._replay_on and c.trusted and not call.padded and not c.stand_in:
                stage = "replay"
                self._replay_after(c, dev, host + hv)
            return RunResult(outs) if hints is None else RunResult(outs, hints, c, call.standins)
        except Exception as e:  # noqa: BLE001 - any failure: poison and answer eagerly
            self._poison(c, f"{stage}: {type(e).__name__}: {e}")
            return None

    def _replay_after(self, c: _Closure, dev: list, given: list) -> None:
        """After the closure answered a trusted call (``dev``: its device inputs; ``given``: the same as the call
        gave them, host arrays and mirrors, hoisted values last): record it for the replay, or check the built
        replay on it."""
        rp = c.replay
        if rp is None:
            t = self.tuning
            rp = c.replay = replay.StepReplay(len(self.program.outputs), t.replay_host_guard, t.replay_staged_feed,
                                              t.replay_pdl)
        if rp.recording():
            with TRACE_LOCK:
                rp.record(c, dev)
        elif rp.pending():
            rp.check(c, given)
            if rp.serving():
                parts = ", ".join(f"{k} {v:.2f}" for k, v in rp.replay.timings.items())
                guard = f"; guard on the {rp.guard_kind}" if rp.guard_kind else ""
                r = rp.replay
                pdl = "; programmatic" if r.pdl else f"; plain ({r.pdl_refused})" if r.pdl_refused else ""
                self.counters["replay"] = (f"{r.launches} launches{pdl} (recorded in {rp.record_s:.2f} s, "
                                           f"built in {rp.build_s:.2f} s: {parts}{guard})")
        if rp.refused and not self.counters["replay"].startswith("refused"):
            self.counters["replay"] = f"refused: {rp.refused}"
            self._fallback(f"decode replay refused: {rp.refused}")

    def _serve_replay(self, c: _Closure, rp, call: "Call", host: list, hv: list) -> "RunResult | object | None":
        """The call answered by ``c``'s replay; None where it declines (the closure answers)."""
        try:
            status, outs, hints = rp.serve(c, host + hv,
                                           lambda: self._upload(c, host) + self._upload_hoisted(c, hv))
        except Exception as e:  # noqa: BLE001 - the closure answers from now on
            rp.refuse(f"serve: {type(e).__name__}: {e}")
            self.counters["replay"] = f"refused: {rp.refused}"
            self._fallback(f"decode replay refused: {rp.refused}")
            return None
        if status == replay.GUARD_FAILED:
            c.guard_fails += 1
            self.counters["guard_fails"] += 1
            return GUARD_FAILED
        if status != replay.SERVED:
            return None
        c.calls += 1
        self.counters["replayed_calls"] += 1
        self.counters["compiled_calls"] += 1
        return RunResult(outs, hints, c, call.standins)

    def _upload(self, c: _Closure, host: list) -> list:
        """The closure's device inputs (``host``: its entries of a call's inputs): MLX arrays as they are
        (device mirrors, runtime/mirror.py), host arrays uploaded. Which ones are host arrays is kept per closure
        while the inputs' types repeat."""
        dev = list(host)
        kinds = tuple(map(type, dev))
        if kinds == c.dev_kinds:
            up = c.dev_up
        else:
            up = [k for k, a in enumerate(dev) if not isinstance(a, mx.array)]
            c.dev_kinds, c.dev_up = kinds, up
        upload = self.program.upload
        for k in up:
            a = dev[k]
            dev[k] = upload(np.asarray(a), self._in_types[c.dev_idx[k]] or dt.onnx_type_of(a))
        return dev

    def _hoisted_values(self, c: _Closure, inputs: list) -> list:
        """The hoisted (shape-derived) values of this call: host arrays, or MLX arrays where the work ran on the
        device. Integer work on host values (genai's mask length: ReduceSum, Sub, Cast) runs in NumPy: a few
        microseconds, no kernels; through the program's NumPy-only runner when it has one (the same host
        forms without a build's dispatch)."""
        run = c.hoist_run
        env = run(inputs) if run is not None else None
        if env is None:             # not all host values this call (or a failure the build reports)
            env = c.hoist_prog.build(list(inputs), host_extra=_HOIST_HOST)
        return [v if isinstance(v, mx.array) else np.asarray(v) for v in map(env.__getitem__, c.hoist)]

    def _upload_hoisted(self, c: _Closure, values: list) -> list:
        """``_hoisted_values`` as MLX arrays."""
        types = self.program.types
        return [v if isinstance(v, mx.array) else dt.to_mx(v, types.get(n) or dt.onnx_type_of(v))
                for n, v in zip(c.hoist, values)]

    def _call_ahead(self, c: _Closure, host: list, dev: list, hv: list, outs: list, prev) -> "ahead.Ahead | None":
        """The next call's closure call, made on this call's (lazy) results (``ahead.py``), or None. Which
        results the next call passes is learnt from the last call's (``prev``) and this one's inputs."""
        pred = ahead.predict(hv, c.ahead_hv)
        c.ahead_hv = hv
        if c.ahead_kinds is None:
            if prev is None or prev[0] is not c:
                return None
            c.ahead_kinds = ahead.learn(host, prev[1])
            if c.ahead_kinds is None:       # nothing chains from call to call: never made ahead
                c.ahead_misses = ahead.MAX_MISSES
                return None
        if pred is None:
            return None
        fn, traces = c.fn, c.traces
        if fn is None:
            return None
        try:
            made = ahead.prepare(c.ahead_kinds, host, dev, outs, c.pick(self._in_types))
            if made is None:
                c.ahead_misses = ahead.MAX_MISSES
                return None
            nxt, views = made
            up = self._upload_hoisted(c, pred)
            if any(u.shape != d.shape or u.dtype != d.dtype for u, d in zip(up, dev[len(host):])):
                return None
            with TRACE_LOCK:
                res = fn(*nxt, *up)
        except Exception as e:  # noqa: BLE001 - no call ahead (this call's own results stand)
            res = None
            self._ahead = False
            self._fallback(f"call ahead failed ({type(e).__name__}: {e}): calls are not made ahead")
        if c.traces != traces:          # (its inputs' shapes and types are this call's: never expected)
            raise RuntimeError("the call made ahead traced the closure again")     # (poisons it: state it set)
        return None if res is None else ahead.Ahead(c, fn, nxt + up, views, pred, res)

    def _eager(self, inputs: list, probe) -> list:
        self.counters["eager_calls"] += 1
        if probe is not None:
            return self.program.run(inputs, probe=probe)
        return self.program.run(inputs)

    def _eager_env(self, inputs: list, probe) -> tuple[list, dict]:
        """Eager results (evaluated) and the whole value environment of the call."""
        self.counters["eager_calls"] += 1
        if probe is not None:
            probe.mark("build")
        env = self.program.build(list(inputs))
        res = [env[o] for o in self.program.outputs]
        lazy = [r for r in res if isinstance(r, mx.array)]
        if probe is not None:
            probe.mark("eval")
        if lazy:
            mx.eval(*lazy)
        return res, env

    # ------------------------------------------------------------------ bookkeeping
    def _built(self, seconds: float) -> None:
        """A closure's first call took ``seconds`` (its trace and kernel builds): counted, and said on the console
        once per process when over ``BUILD_NOTICE_S`` (a user otherwise sees a frozen program)."""
        self.counters["build_s"] = round(self.counters.get("build_s", 0.0) + seconds, 3)
        if seconds > BUILD_NOTICE_S and not _NOTICED:
            _NOTICED.append(seconds)
            sys.stderr.write(f"MLXExecutionProvider: the first {self.label} call at new shapes (group {self.name}) took "
                             f"{seconds:.1f} s tracing and building MLX kernels (kept under {mlx_cache_dir()}); later "
                             "calls replay it." + (" `python -m ortmlx warmup MODEL_DIR` prepares a genai model's "
                                                   "prompt sizes ahead." if self.label != "general" else "") + "\n")

    def _heads_up(self) -> threading.Timer | None:
        """A timer that says, once per process, that kernels are being built when a closure's first call runs past
        ``HEADS_UP_S`` (cancelled when the call returns)."""
        if _HEADS_UP or _NOTICED:
            return None

        def say():
            if not _HEADS_UP:
                _HEADS_UP.append(True)
                sys.stderr.write(f"MLXExecutionProvider: building MLX kernels for the first {self.label} call at new "
                                 f"shapes (group {self.name}); on a host's first run this takes a minute or more, "
                                 f"later processes load them from {mlx_cache_dir()}\n")
                sys.stderr.flush()
        t = threading.Timer(HEADS_UP_S, say)
        t.daemon = True
        t.start()
        return t

    def _poison(self, c: _Closure, why: str) -> None:
        c.poisoned = why
        c.fn = None
        if c.replay is not None:
            c.replay.release()
        c.trusted = False
        self._proven = False            # any doubt: later closures prove themselves at two shapes again
        self.counters["poisoned"] = why[:300]
        self.counters["poisoned_closures"] += 1
        self._fallback(f"{self.config.name} closure poisoned: {why}", once=False)

    def _fallback(self, why: str, once: bool = True) -> None:
        if once:
            if why in self._said:
                return
            self._said.add(why)
        if self.stats is not None:
            self.stats.fallback(self.name, why[:500])



def _hint_mismatch(hints: RowHints, outs: list) -> str | None:
    """Why the row hints of a call are not the rows its presents hold at their starts (None: they are):
    Compute writes only these rows back to genai's buffer, so a verified call checks them too."""
    for j, (_, starts, raw, shape) in hints.per_output(*hints.split(hints.host_data())).items():
        present = dt.host(outs[j])
        rows = raw.view(present.dtype).reshape(shape)
        s = shape[-2]
        for b, s0 in enumerate(starts.tolist()):
            if not np.array_equal(present[b, ..., s0:s0 + s, :].view(np.uint8), rows[b].view(np.uint8)):
                return f"row hints of output {j} differ from its rows {s0}..{s0 + s - 1} (batch row {b})"
    return None


def _spin_waiter():
    """The CUDA driver's context synchronize when it polls (tuning ``spin_wait``), else None."""
    drv = cuda_driver.driver()
    try:
        return drv.synchronize if drv is not None and drv.spins() else None
    except Exception:  # noqa: BLE001 - no driver context: MLX's wait only
        return None


#: NumPy forms for hoisted integer work that has no registered host form (``Program.build(host_extra=)``)
_HOIST_HOST = {"ReduceSum": reduce_sum_ints_host}
def picker(idx) -> "callable":
    """A function giving the entries ``idx`` of a list as a tuple (one C call: ``operator.itemgetter``)."""
    idx = tuple(idx)
    if len(idx) > 1:
        return operator.itemgetter(*idx)
    if idx:
        j = idx[0]
        return lambda xs: (xs[j],)
    return lambda xs: ()


def _host_bytes(plan: HostPlan, inputs: list) -> tuple:
    """The values of the inputs a trace bakes in (part of the key)."""
    return tuple(None if inputs[i] is None else np.ascontiguousarray(inputs[i]).tobytes()
                 for i in sorted(plan.host_inputs))


def with_overrides(program, overrides: dict):
    """A shallow copy of ``program`` whose steps ``i`` use ``overrides[i]`` (an OpDef)."""
    if not overrides:
        return program
    p = copy.copy(program)
    p.steps = [dataclasses.replace(st, opdef=overrides[i]) if i in overrides else st
               for i, st in enumerate(program.steps)]
    return p


def sub_program(program, steps, inputs: list, outputs):
    """A shallow copy of ``program`` keeping ``steps`` (indices), with new inputs and outputs."""
    keep = set(steps)
    p = copy.copy(program)
    p.steps = [st for k, st in enumerate(program.steps) if k in keep]
    p.inputs = list(inputs)
    p.outputs = list(outputs)
    # only the constants the kept steps read (a build starts from a copy of them: the hoisted mask work
    # of a 24-layer model would copy every weight's entry per call)
    read = {n for st in p.steps for n in st.inputs if n} | set(p.outputs)
    for st in p.steps:
        for _, names in (st.bodies or {}).values():
            read.update(names)
    p.constants = {n: v for n, v in program.constants.items() if n in read}
    p.host_constants = {n: v for n, v in program.host_constants.items() if n in read}
    return p

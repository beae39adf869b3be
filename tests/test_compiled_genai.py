"""Compiled decode/prefill on the tiny genai LLMs: one decode trace, tokens identical to eager and CPU.

The models come from models/build_llm.py (built once, cached under models/out/). On MLX's CPU
backend the first run JIT-builds fused kernels with g++ (cached under $TMPDIR/mlx): the first
test takes tens of seconds on a cold cache, about a second warm.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")

import ortmlx  # noqa: E402
import ortmlx.compiled as C  # noqa: E402
from ortmlx import genai as mg  # noqa: E402
from ortmlx.testing import child_env  # noqa: E402

pytestmark = pytest.mark.genai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("ORTMLX_MODELS_OUT", os.path.join(ROOT, "models", "out"))
#: prompt lengths 16, 7, 11, 20: prefill buckets 16, 16, 16, 32
PROMPTS = ([510, 5, 17, 33, 90, 12, 7, 100, 200, 3, 4, 5, 6, 7, 8, 9], [510, 44, 45, 46, 47, 48, 9],
           [510, 300, 301, 302, 8, 9, 10, 11, 12, 13, 14], [510] + list(range(60, 79)))
N = 64
#: genai's max_length: the shared KV buffer's length, the same for every prompt
MAX_LENGTH = 160
SHARE = {"search": {"past_present_share_buffer": True}}
NOSHARE = {"search": {"past_present_share_buffer": False}}


def model_dir(arch: str, precision: str = "fp32") -> str:
    """The tiny model, built if missing (a subprocess: torch stays out of the test process)."""
    path = os.path.join(OUT, f"{arch}-tiny-{precision}")
    if not os.path.exists(os.path.join(path, "genai_config.json")):
        for mod in ("torch", "transformers", "tokenizers", "onnx_ir"):
            pytest.importorskip(mod, reason=f"{mod} is needed to build the test LLMs (pip install .[genai])")
        res = subprocess.run([sys.executable, os.path.join(ROOT, "models", "build_llm.py"), "--arch", arch,
                              "--precision", precision, "--size", "tiny", "--out", OUT],
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
    return path


class Snap:
    """What one compiled part did (read before the session releases its closures)."""

    def __init__(self, part):
        self.trace_counts = part.trace_counts()
        self.n_closures = len(part.closures())
        self.counters = dict(part.counters)
        #: per closure with hoisted work: the closed form's check state (``hoist_form.checked``), or None
        self.hoist_checks = [dict(getattr(c.hoist_run, "state", None) or {}) or None
                             for c in part.closures() if c.hoist]


class Runner:
    def __init__(self, r):
        self.is_attention = hasattr(r, "decode")
        self.decode = Snap(r.decode) if self.is_attention and r.decode is not None else None
        self.prefill = Snap(r.prefill) if self.is_attention and r.prefill is not None else None
        self.prefill_exact = Snap(r.prefill_exact) if self.is_attention and r.prefill_exact is not None else None
        self.eager_calls = getattr(r, "eager_calls", 0)
        self.parts = [Snap(p) for p in r.parts()]


def run(path: str, provider: str = "mlx", options: dict | None = None, overlay: dict | None = None,
        twice: bool = False, prompts=PROMPTS):
    """(greedy tokens for every prompt, snapshots of the compiled runners the session made); ``twice``: every
    prompt is generated twice in a row (the tokens of the second generation are returned)."""
    with C.capture() as rs:
        model, _ = mg.load_model(path, provider, options, overlay or SHARE)
    toks = [(greedy(model, p), greedy(model, p))[-1] if twice else greedy(model, p) for p in prompts]
    snaps = [Runner(r) for r in rs]
    del model
    return toks, snaps


def greedy(model, ids) -> list[int]:
    """N greedy tokens after ``ids`` with a fixed max_length (one KV buffer size for all prompts)."""
    params = mg.search_options(model, MAX_LENGTH, len(ids) + N)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(ids, np.int32))
    out = []
    while len(out) < N and not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def attention_parts(rs):
    att = [r for r in rs if r.is_attention]
    assert len(att) == 1, rs
    return att[0]


def prefill_as_eager(prompts) -> tuple:
    """(the prefill runner's snapshot, all runners') of the tiny qwen2 compiled over ``prompts``, its tokens checked
    equal to eager's."""
    path = model_dir("qwen2")
    eager, _ = run(path, options={"no_compile": "1"}, prompts=prompts)
    got, rs = run(path, prompts=prompts)
    assert got == eager
    return attention_parts(rs).prefill, rs


def test_a_later_bucket_is_trusted_after_one_match():
    """A bucket's first call matches eager at its length and at one token less (the same bucket); once one bucket's
    closure matched at two lengths, a later bucket's is trusted at its first match (the same traced body): 16 (and
    15) verify bucket 16, 7 replays it, 20 verifies bucket 32, 25 replays it."""
    pre, rs = prefill_as_eager(PROMPTS[:2] + (PROMPTS[3], [510] + list(range(90, 114))))
    assert pre.trace_counts == [1, 1], pre.counters
    assert (pre.counters["verify_calls"], pre.counters["compiled_calls"]) == (3, 2), pre.counters
    assert no_poison(rs) == []


def test_a_bucket_wrong_at_another_length_is_caught_in_its_first_call(monkeypatch):
    """The first call's second match (the prompt less its last token, in the same bucket) is a real check: a prefill
    closure right at its first call's length and wrong at any other is poisoned in that first call, and every
    answer is eager's."""
    from ortmlx.compiled import core
    real = core.compile_closure

    def wrong_after_first(c, *a, **k):
        fn = real(c, *a, **k)
        if a[2].name != "prefill":
            return fn
        calls = []

        def f(*dev):
            outs = fn(*dev)
            calls.append(1)
            return outs if len(calls) == 1 else [outs[0] + 1] + list(outs[1:])
        return f
    monkeypatch.setattr(core, "compile_closure", wrong_after_first)
    pre, _ = prefill_as_eager(PROMPTS[:1])
    assert pre.counters["verify_calls"] == 2 and "differ" in pre.counters["poisoned"], pre.counters


def test_a_failing_second_length_leaves_the_bucket_to_its_next_call(monkeypatch):
    """Where the other length cannot be made or run, the first call answers as before and the bucket's next
    call of another length makes its second match (16 and 7 verify bucket 16, 11 replays)."""
    from ortmlx.compiled.attention import BucketedPrefill

    def fails(self, inputs):
        raise RuntimeError("no other length")
    monkeypatch.setattr(BucketedPrefill, "_another_length", fails)
    pre, rs = prefill_as_eager(PROMPTS[:3])
    assert (pre.counters["verify_calls"], pre.counters["compiled_calls"]) == (2, 1), pre.counters
    assert no_poison(rs) == []


def no_poison(rs):
    return [p.counters["poisoned"] for r in rs for p in r.parts if p.counters["poisoned"]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_decode_traces_once_tokens_match_eager_and_cpu(arch):
    path = model_dir(arch)
    cpu, _ = run(path, "cpu")
    eager, none = run(path, options={"no_compile": "1"})
    got, rs = run(path)
    assert none == []
    assert got == eager == cpu
    att = attention_parts(rs)
    # one shapeless decode closure for all generations, traced exactly once; the first two decode
    # calls (two different lengths) verify against eager, every later one replays
    assert att.decode.trace_counts == [1], (att.decode.counters, att.decode.n_closures)
    assert att.decode.counters["verify_calls"] == 2, att.decode.counters
    assert att.decode.counters["compiled_calls"] == len(PROMPTS) * (N - 1) - 2, att.decode.counters
    # prefill: one trace per bucket (16: lengths 16, 7, 11; 32: length 20); bucket 16's first call matched eager
    # at two lengths (16 and 15), so 7 and 11 replay, and bucket 32 is trusted at its first match
    assert att.prefill.trace_counts == [1, 1], att.prefill.counters
    assert att.prefill.counters["verify_calls"] == 3 and att.prefill.counters["compiled_calls"] == 2
    assert att.prefill_exact.trace_counts == []
    assert no_poison(rs) == []
    # the decode closure's hoisted mask work ran through its closed form, equal to the generic runner
    assert att.decode.hoist_checks == [{"left": 0, "bad": False}], att.decode.hoist_checks


@pytest.mark.parametrize("options,env,decode,prefill", [
    ({"no_decode_compile": "1"}, {}, False, True),
    ({"no_prefill_compile": "1"}, {}, True, False),
    ({}, {"MLX_EP_NO_PREFILL_COMPILE": "1"}, True, False),
    ({}, {"ORTMLX_NO_DECODE_COMPILE": "1"}, False, True),
    ({"no_general_compile": "1"}, {}, True, True),
    ({}, {"ONNX_GENAI_MLX_NO_COMPILE": "1"}, False, False),
    ({"tuning": "compile_mode=disabled"}, {}, False, False),
    ({"no_compile": "decode"}, {}, False, True),
    ({"no_compile": "prefill,general"}, {}, True, False),
])
def test_kill_switches_flip_decode_and_prefill(monkeypatch, options, env, decode, prefill):
    path = model_dir("llama")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    want, _ = run(path, options={"no_compile": "1"})
    got, rs = run(path, options=options)
    assert got == want
    att = [r for r in rs if r.is_attention]
    if not (decode or prefill):
        assert att == []
        return
    (att,) = att
    assert (att.decode is not None) == decode and (att.prefill is not None) == prefill
    if decode:
        assert att.decode.trace_counts == [1] and att.decode.counters["compiled_calls"] > 0
    else:
        assert att.eager_calls == len(PROMPTS) * (N - 1)  # every decode call ran eagerly
    if prefill:
        assert att.prefill.trace_counts == [1, 1]
    else:
        assert att.eager_calls >= len(PROMPTS)           # every prefill call ran eagerly


def test_noshare_kv_contract_same_tokens():
    """Past and present are separate, growing buffers: whatever compiles, the tokens are eager's."""
    path = model_dir("llama")
    want, _ = run(path, options={"no_compile": "1"}, overlay=NOSHARE)
    got, rs = run(path, overlay=NOSHARE)
    assert got == want


@pytest.mark.parametrize("fault", ["wrong", "raise"])
def test_decode_fault_falls_back_with_same_tokens(fault):
    """A decode closure that computes a wrong value (or fails to trace) is poisoned at its first
    verification; every decode call then answers from eager, with the same tokens."""
    path = model_dir("llama")
    want, _ = run(path, options={"no_compile": "1"})
    with C.capture() as rs:
        model, _ = mg.load_model(path, "mlx", None, SHARE)
    (att,) = [r for r in rs if hasattr(r, "decode")]
    steps = att.decode.trace_program.steps
    k = next(i for i, st in enumerate(steps) if st.node.op_type == "GroupQueryAttention")
    orig = steps[k].opdef.fn

    def bad(*args, **attrs):
        if fault == "raise":
            raise RuntimeError("injected decode trace failure")
        out, pk, pv = orig(*args, **attrs)
        return out + 1e-2, pk, pv

    steps[k].opdef = dataclasses.replace(steps[k].opdef, fn=bad)
    got = [greedy(model, p) for p in PROMPTS]
    d = att.decode
    counters, closures = dict(d.counters), d.closures()
    del model
    assert got == want
    assert counters["compiled_calls"] == 0 and counters["poisoned_closures"] == 1, counters
    assert [(c.fn, c.traces, c.calls) for c in closures] == [(None, 1, 1 if fault == "wrong" else 0)]
    assert counters["eager_calls"] == len(PROMPTS) * (N - 1)


def test_kv_mirror_same_tokens_and_rows_only(monkeypatch):
    """The shared KV buffer stays on the device (ep/mirror.py): tokens equal the no-mirror run's,
    and a decode call moves the same few bytes at every context length (O(new tokens)). A prompt
    (its bucket's closure trusted by the earlier generations) uploads none of the buffer (zeros stand
    in for the past it does not read) and writes back only its bucket's rows of each buffer."""
    from ortmlx.runtime import residency
    from ortmlx.runtime import group
    monkeypatch.setattr(group, "WHOLE_COPY_BYTES", [0, 0])     # diff even this tiny model's buffers
    path = model_dir("llama")
    want, _ = run(path, options={"tuning": "kv_mirror=0"})
    model, _ = mg.load_model(path, "mlx", None, SHARE)
    got = [greedy(model, p) for p in PROMPTS]
    params = mg.search_options(model, MAX_LENGTH, len(PROMPTS[0]) + N)
    gen = og.Generator(model, params)
    residency.reset()
    gen.append_tokens(np.asarray(PROMPTS[0], np.int32))
    prompt = residency.snapshot()
    per = []
    while len(per) < N and not gen.is_done():
        residency.reset()
        gen.generate_next_token()
        per.append(residency.snapshot())
    del gen, model
    assert got == want
    decode = [p for p in per if p["calls"]]     # genai 0.18 runs the prompt in append_tokens
    assert len(decode) >= N - 2
    assert all(p["calls"] == 1 for p in decode)
    h2d = {p["h2d_bytes"] for p in decode}
    d2h = {p["d2h_bytes"] for p in decode}
    # input ids + the growing attention mask in, logits + one K/V row per layer and head out
    assert max(h2d) - min(h2d) == 8 * (len(decode) - 1), sorted(h2d)      # the int64 mask grows
    assert len(d2h) == 1, sorted(d2h)
    import json
    with open(os.path.join(path, "genai_config.json")) as f:
        cfg = json.load(f)["model"]
    dec, s = cfg["decoder"], len(PROMPTS[0])           # 16 tokens: its own bucket
    row = dec["num_key_value_heads"] * dec["head_size"] * 4          # one float32 K or V row
    buffers = 2 * dec["num_hidden_layers"]
    assert prompt["h2d_bytes"] < buffers * row * MAX_LENGTH / 10, prompt
    assert prompt["d2h_bytes"] == s * cfg["vocab_size"] * 4 + buffers * row * s, prompt     # logits + new rows


def _rewind_and_interleave(model) -> list[list[int]]:
    """Two generators alive at once, stepped in turn (two KV buffers on one session), one of them
    rewound mid-way (its buffer keeps rows past the new length) and continued."""
    params = mg.search_options(model, MAX_LENGTH, 0)
    a, b = og.Generator(model, params), og.Generator(model, params)
    a.append_tokens(np.asarray(PROMPTS[0], np.int32))
    b.append_tokens(np.asarray(PROMPTS[1], np.int32))
    ta, tb = [], []
    for _ in range(12):
        a.generate_next_token()
        ta.append(int(a.get_next_tokens()[0]))
        b.generate_next_token()
        tb.append(int(b.get_next_tokens()[0]))
    a.rewind_to(len(PROMPTS[0]) + 5)
    del ta[6:]
    a.append_tokens(np.asarray([300, 301, 302], np.int32))
    for _ in range(10):
        a.generate_next_token()
        ta.append(int(a.get_next_tokens()[0]))
        b.generate_next_token()
        tb.append(int(b.get_next_tokens()[0]))
    return [ta, tb]


@pytest.mark.parametrize("force_diff", [False, True])
def test_kv_mirror_rewind_and_two_generators(monkeypatch, force_diff):
    """genai rewind_to and two live generators: the same tokens with and without the mirror, and
    as the CPU EP's."""
    from ortmlx.runtime import group
    if force_diff:
        monkeypatch.setattr(group, "WHOLE_COPY_BYTES", [0, 0])
    path = model_dir("qwen2")
    got = {}
    for key, provider, opts in (("cpu", "cpu", None), (False, "mlx", {"tuning": "kv_mirror=0"}), (True, "mlx", {})):
        model, _ = mg.load_model(path, provider, opts, SHARE)
        got[key] = _rewind_and_interleave(model)
        del model
    assert got[False] == got[True] == got["cpu"]
    assert len(got[True][0]) == 6 + 10 and len(got[True][1]) == 22


@pytest.mark.parametrize("block", [1, 5])
def test_soak_kv_script_quick(block):
    """scripts/soak_kv.py (random prompts, rewinds, two generators; CPU EP replay) on a few generations; with
    turns of 5 steps, with the next call's closure call made ahead (ORTMLX_TUNING=call_ahead=1: a GPU's default)."""
    path = model_dir("qwen2")
    env = dict(os.environ, ORTMLX_TUNING=("call_ahead=1" if block > 1 else "call_ahead=0") + ",build_behind=0")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "soak_kv.py"), "--model", path,
                          "--generations", "6", "--force-diff", "--block", str(block)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    import json
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["wrong_generations"] == 0 and out["tokens"] > 6 * 10, out
    assert (out["calls_made_ahead"] > 10) == (block > 1), out


def test_decode_closure_sees_fixed_shapes_only():
    """The attention mask (whose length grows every token) reaches the decode closure only through
    values hoisted per call (seqlens_k, total length): no step in the trace reads it, so every value
    the closure computes on has a fixed shape; tokens stay eager's."""
    path = model_dir("llama")
    want, _ = run(path, options={"no_compile": "1"})
    with C.capture() as rs:
        model, _ = mg.load_model(path, "mlx", None, SHARE)
    got = [greedy(model, p) for p in PROMPTS]
    (att,) = [r for r in rs if hasattr(r, "decode")]
    (c,) = att.decode.closures()
    mask = [n for n in att.decode.program.inputs if "attention_mask" in n]
    traced_inputs = {n for st in c.trace_prog.steps for n in st.inputs}
    hoist, trusted, shapeless, traces = c.hoist, c.trusted, c.shapeless, c.traces
    passed = {att.decode.program.inputs[i] for i in c.dev_idx if i < len(att.decode.program.inputs)}
    kv = dict(att.decode.stats.groups[att.name]["kv_copy_out"])       # the verbose summary's counters
    del model
    assert got == want
    assert mask and not (set(mask) & traced_inputs), sorted(traced_inputs & set(mask))
    assert len(hoist) >= 2 and trusted, hoist
    # the mask is not even passed, so the closure is traced shape-keyed, once for all 4 prompts
    assert not (set(mask) & passed) and shapeless is False and traces == 1, (sorted(passed), shapeless, traces)
    # decode K/V rows go back from the closure's row hints, even for buffers small enough to copy whole
    assert kv["batched"] + kv["row_hints"] > 4 * (kv["whole"] + kv["diffed"]), kv
    assert kv["batched"] > kv["row_hints"], kv        # steady calls write every K/V row in one batch


def test_hoisted_mask_work_runs_in_numpy():
    """The decode closure's hoisted mask arithmetic (Shape, Gather, ReduceSum, Sub, Cast) runs through its
    program's NumPy-only runner: every steady call, and for any mask the same values and types as a build;
    a mask on the device leaves it to the build."""
    import mlx.core as mx

    from ortmlx.compiled import core
    path = model_dir("llama")
    with C.capture() as rs:
        model, _ = mg.load_model(path, "mlx", None, SHARE)
    (att,) = [r for r in rs if hasattr(r, "decode")]
    greedy(model, PROMPTS[0])
    (c,) = att.decode.closures()
    assert c.hoist and c.hoist_run is not None
    builds = []
    real = c.hoist_prog.build
    c.hoist_prog.build = lambda *a, **k: builds.append(1) or real(*a, **k)
    got = greedy(model, PROMPTS[1])
    del model
    assert got and not builds, f"{len(builds)} calls built the hoisted values"
    names = att.decode.program.inputs
    (at,) = [i for i, n in enumerate(names) if "attention_mask" in n]
    rng = np.random.default_rng(3)
    for length in (1, 2, 17, 40):
        for mask in (np.ones((1, length), np.int64), (rng.random((2, length)) > 0.3).astype(np.int64)):
            inputs = [None] * len(names)
            inputs[at] = mask
            fast = c.hoist_run(inputs)
            want = real(list(inputs), host_extra=core._HOIST_HOST)
            for n in c.hoist:
                assert fast[n].dtype == want[n].dtype and np.array_equal(fast[n], want[n]), (n, fast[n], want[n])
    inputs[at] = mx.array(np.ones((1, 5), np.int64))
    assert c.hoist_run(inputs) is None


def test_decode_copy_out_uses_row_hints(monkeypatch):
    """A trusted decode closure declares the one row each K/V buffer gets (decode_ops.add_row_hint):
    copy-out writes it without diffing; only the eager/verifying calls diff. Same tokens."""
    from ortmlx.runtime import group
    monkeypatch.setattr(group, "WHOLE_COPY_BYTES", [0, 0])
    diffs = []
    real = group.changed_rows
    monkeypatch.setattr(group, "changed_rows", lambda *a, **k: diffs.append(1) or real(*a, **k))
    path = model_dir("llama")
    want, _ = run(path, options={"tuning": "kv_mirror=0"})
    model, _ = mg.load_model(path, "mlx", None, SHARE)
    diffs.clear()
    got = [greedy(model, p) for p in PROMPTS]
    del model
    assert got == want
    decode_calls = len(PROMPTS) * (N - 1)
    assert len(diffs) <= 4, (len(diffs), decode_calls)


def test_eager_attention_layers_share_rotary_rows(monkeypatch):
    """Every GroupQueryAttention layer of an eager run reads the same rotary rows and mask: made once
    per run (kernels/consts.memo), not once per layer; same tokens."""
    from ortmlx.kernels.ops import contrib_attention as ca
    path = model_dir("llama")
    want, _ = run(path, options={"no_compile": "1", "tuning": "kv_mirror=0"})
    from ortmlx.kernels.interpreter import Program
    calls, runs = [], []
    real, real_run = ca.rotary_tables, Program.run
    monkeypatch.setattr(ca, "rotary_tables", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(Program, "run", lambda self, *a, **k: runs.append(self) or real_run(self, *a, **k))
    model, _ = mg.load_model(path, "mlx", {"no_compile": "1"}, SHARE)
    gen = og.Generator(model, mg.search_options(model, MAX_LENGTH, len(PROMPTS[1]) + 8))
    gen.append_tokens(np.asarray(PROMPTS[1], np.int32))
    toks = []
    for _ in range(8):
        gen.generate_next_token()
        toks.append(int(gen.get_next_tokens()[0]))
    layers = sum(st.node.op_type == "GroupQueryAttention" for st in runs[0].steps)
    del gen, model
    assert toks == want[1][:8]
    assert layers >= 2 and len(runs) >= 8 and len(calls) == len(runs), (layers, len(runs), len(calls))


def test_step_probe_script_quick():
    """scripts/step_probe.py still wraps every stage it names (a renamed method fails it) and its stages nest:
    each stage is inside its parent in every token, so its median is at most the parent's (structure only: no
    timing threshold)."""
    path = model_dir("qwen2")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "step_probe.py"), path, "--tokens", "12"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "failed" not in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    ms = {}
    for line in res.stdout.splitlines()[1:]:
        name, value = line.split()
        ms[name] = float(value)
    for stage in ("token", "compute", "copy_in.gather", "copy_out", "run.apply", "run.apply.closure_call",
                  "run.apply.eval"):
        assert stage in ms, (stage, res.stdout)
    # a steady decode call's key: worked out again from the last one's for the inputs the gather saw change
    assert "run.key_since" in ms or "run.key" in ms, res.stdout
    for child, parent in (("run.apply.eval", "run.apply"), ("run.apply.closure_call", "run.apply"),
                          ("run.apply", "run"), ("run", "compute"), ("copy_out", "compute"), ("compute", "token")):
        assert 0 <= ms[child] <= ms[parent], (child, parent, ms)
    for child, parent in (("copy_in.mirrors.kv_take", "copy_in.mirrors"), ("copy_out.kv_batch.layout", "copy_out.kv_batch"),
                          ("copy_out.kv_batch.write", "copy_out.kv_batch")):
        if child in ms:                 # the KV batch's stages (a run whose buffers never batched has none)
            assert 0 <= ms[child] <= ms[parent], (child, parent, ms)
    assert 0 <= ms["ep_python"] <= ms["compute"], ms


def test_step_probe_alternates_trees():
    """``step_probe.py --tree DIR --rounds N`` runs DIR's ortmlx in processes alternating with this checkout's and
    ends with each configuration's medians (here DIR holds the ortmlx this process runs, a checkout's or the
    installed one: both configurations run the same code)."""
    path = model_dir("qwen2")
    tree = os.path.dirname(os.path.dirname(os.path.abspath(ortmlx.__file__)))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "step_probe.py"), path, "--tokens", "8",
                          "--tree", tree, "--rounds", "2"], capture_output=True, text=True, timeout=300,
                         env=child_env())
    assert res.returncode == 0 and "failed" not in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    heads = [line for line in res.stdout.splitlines() if line.startswith("[")]
    assert len(heads) == 4 and sum(f"@ {tree}" in h for h in heads) == 2, heads
    summary = res.stdout.split("medians over the rounds")[-1].strip().splitlines()[1:]
    assert len(summary) == 2 and summary[1].lstrip().startswith(f"default @ {tree}"), summary


def _batch_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Static batching: the prompts right-padded to one length (genai's pad token), n new tokens each."""
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), 0, np.int32)
    for k, p in enumerate(prompts):
        ids[k, :len(p)] = p
    params = mg.search_options(model, MAX_LENGTH, width + n)
    params.set_search_options(batch_size=len(prompts))
    g = og.Generator(model, params)
    g.append_tokens(ids)
    for _ in range(n):
        g.generate_next_token()
    return [list(g.get_sequence(k))[width:] for k in range(len(prompts))]


def test_batched_decode_on_mirrors_matches_the_cpu_ep():
    """Batch 3 of equal-length prompts (genai's static batching, the shared KV buffer): the decode steps run on
    device mirrors of the batch's buffers, the tokens are the CPU EP's and the unmirrored EP's."""
    path = model_dir("qwen2")
    prompts = [PROMPTS[0], [510] + list(range(100, 115)), [510] + list(range(200, 215))]
    toks = {}
    for key, provider, opts in (("cpu", "cpu", None), ("plain", "mlx", {"tuning": "kv_mirror=0"}), ("mirror", "mlx", {})):
        with C.capture() as rs:
            model, _ = mg.load_model(path, provider, opts, SHARE)
        toks[key] = _batch_greedy(model, prompts, 24)
        if key == "mirror":
            (att,) = [r for r in rs if hasattr(r, "decode")]
            kv = dict(att.decode.stats.groups[att.name]["kv_copy_out"])
        del model
    assert toks["mirror"] == toks["plain"] == toks["cpu"], toks
    assert kv["batched"] > 4 * (kv["whole"] + kv["row_hints"] + kv["diffed"]), kv   # rows, in one C copy a call


def test_a_batch_of_equal_length_prompts_is_padded_to_a_bucket():
    """genai's static batching with every row the same length (the mask all ones): the prompts pad to a bucket as a
    lone prompt does (every row's padding dropped), so a new length in a trusted bucket replays, where each
    (length, batch) key traced one closure of its own at its second sight before; tokens as the CPU EP's."""
    path = model_dir("qwen2")
    batches = [[[510] + list(range(a, a + n - 1)) for a in (100, 200, 300)] for n in (20, 25, 27, 40)]
    toks = {}
    for key, provider in (("cpu", "cpu"), ("mlx", "mlx")):
        with C.capture() as rs:
            model, _ = mg.load_model(path, provider, None, SHARE)
        toks[key] = [_batch_greedy(model, b, 8) for b in batches]
        if key == "mlx":
            (att,) = [r for r in rs if hasattr(r, "prefill")]
            pre, exact = dict(att.prefill.counters), att.prefill_exact
        del model
    assert toks["mlx"] == toks["cpu"], toks
    # 20 verifies bucket 32 at two lengths (20 and 19), 25 and 27 replay it, 40 verifies bucket 64 at its first match
    assert (pre["traces"], pre["verify_calls"], pre["compiled_calls"]) == (2, 3, 2) and not pre["poisoned"], pre
    assert exact is None or exact.counters["traces"] == 0, exact.counters

"""Calls made ahead (compiled/ahead.py): the next decode call's closure call made while this one's eval runs.

On a GPU the runner makes them by default; here (MLX's CPU backend) they are switched on by hand. A call
made ahead is taken only when it is exactly the call the runner would make: the same device arrays, host
inputs of the same shape and type (their bytes written into the slots), hoisted values equal to the
prediction. The genai test compares every step's logits bit for bit with the runner without them.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.compiled import ahead, core


class Clo:
    """The closure state ``ahead`` reads (``core._Closure``'s fields)."""

    def __init__(self, fn):
        self.fn = fn
        self.ahead_kinds = None
        self.ahead_misses = 0


def _step(ids, kv, n):
    """A decode-like step: the new KV is the old plus the token's value times the length."""
    new = kv + ids.astype(mx.float32).reshape(-1) * n.astype(mx.float32)
    return [new.sum(), new]


def made_ahead(c, ids: np.ndarray, kv: mx.array, n: np.ndarray, n_prev: np.ndarray):
    """This call's outputs and the next call made ahead (``core.CompiledSubgraph._call_ahead``'s steps)."""
    dev = [mx.array(ids), kv, mx.array(n)]
    outs = c.fn(*dev)
    mx.async_eval(*outs)
    kinds = ahead.learn([ids, kv], [None, kv])      # (kv passed on: index 1 of the last call's outputs)
    pred = ahead.predict([n], [n_prev])
    nxt, views = ahead.prepare(kinds, [ids, kv], dev, outs, [None, None])
    up = [mx.array(p) for p in pred]
    return outs, ahead.Ahead(c, c.fn, nxt + up, views, pred, c.fn(*nxt, *up))


def test_learn_marks_results_passed_on_device_arrays_kept_and_host_inputs():
    prev = [mx.array([1.0]), mx.array([2.0]), mx.array([3.0])]
    kept = mx.array([4.0])
    assert ahead.learn([np.zeros(2), prev[2], kept, prev[0]], prev) == (ahead.SLOT, 2, ahead.SAME, 0)
    # equal values are not the same arrays: nothing chains
    assert ahead.learn([np.zeros(2), mx.array([3.0]), kept], prev) is None


def test_predict_moves_integers_by_their_last_step_only():
    cur, prev = [np.array([12], np.int32), np.array(7, np.int64), np.array([0.5], np.float32)], \
        [np.array([11], np.int32), np.array(9, np.int64), np.array([0.25], np.float32)]
    got = ahead.predict(cur, prev)
    assert [g.tolist() for g in got] == [[13], 5, [0.5]]
    assert [g.dtype for g in got] == [np.int32, np.int64, np.float32]
    assert ahead.predict([], None) == []
    assert ahead.predict(cur, None) is None                     # no last call: no step to take
    assert ahead.predict([mx.array([1])], [mx.array([0])]) is None   # a device value cannot be predicted
    # a changed shape or type: the value is predicted unchanged (the call checks it anyway)
    assert ahead.predict([np.array([3, 4], np.int32)], [np.array([2], np.int32)])[0].tolist() == [3, 4]


def test_taken_call_is_the_call_on_the_new_inputs():
    c = Clo(mx.compile(_step))
    kv = mx.array(np.arange(4, dtype=np.float32))
    outs, nxt = made_ahead(c, np.array([[5]], np.int64), kv, np.array([3], np.int32), np.array([2], np.int32))
    mx.eval(*outs)
    ids2 = np.array([[9]], np.int64)
    got = ahead.take(nxt, c, [ids2, outs[1]], [np.array([4], np.int32)])
    assert got is nxt.outs
    want = _step(mx.array(ids2), outs[1], mx.array(np.array([4], np.int32)))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.array(g), np.array(w))
    # the slot now holds the new token (not the one it was made with)
    assert np.asarray(nxt.views[0]).tolist() == [[9]]


@pytest.mark.parametrize("change", ["hoisted value", "hoisted type", "host shape", "host type", "device array",
                                    "closure", "closure's function"])
def test_take_refuses_any_other_call(change):
    c = Clo(mx.compile(_step))
    kv = mx.array(np.arange(4, dtype=np.float32))
    outs, nxt = made_ahead(c, np.array([[5]], np.int64), kv, np.array([3], np.int32), np.array([2], np.int32))
    mx.eval(*outs)
    host, hv, cc = [np.array([[9]], np.int64), outs[1]], [np.array([4], np.int32)], c
    if change == "hoisted value":
        hv = [np.array([5], np.int32)]
    elif change == "hoisted type":
        hv = [np.array([4], np.int64)]
    elif change == "host shape":
        host[0] = np.array([[9, 9]], np.int64)
    elif change == "host type":
        host[0] = np.array([[9]], np.int32)
    elif change == "device array":
        host[1] = mx.array(np.array(outs[1]))              # equal values, another array
    elif change == "closure":
        cc = Clo(c.fn)
    else:
        c.fn = mx.compile(_step)
    slot = nxt.views[0].copy()
    assert ahead.take(nxt, cc, host, hv) is None
    assert np.array_equal(nxt.views[0], slot)             # nothing written when refused


def test_prepare_refuses_inputs_the_closure_would_retrace_for():
    kv = mx.array(np.zeros(4, np.float32))
    ids = np.array([[1]], np.int64)
    dev = [mx.array(ids), kv]
    wider = [mx.array([0.0]), mx.zeros(5)]                  # a result of another shape passed on
    assert ahead.prepare((ahead.SLOT, 1), [ids, kv], dev, wider, [None, None]) is None
    ok = [mx.array([0.0]), mx.zeros(4)]
    nxt, views = ahead.prepare((ahead.SLOT, 1), [ids, kv], dev, ok, [None, None])
    assert nxt[1] is ok[1] and set(views) == {0}
    assert ahead.prepare((ahead.SLOT, ahead.SAME), [ids, np.zeros(4, np.float32)], dev, ok, [None, None]) is None


def test_due_pauses_after_misses_then_learns_again():
    c = Clo(None)
    c.ahead_kinds = (0,)
    assert ahead.due(c)
    c.ahead_misses = ahead.MAX_MISSES
    paused = [ahead.due(c) for _ in range(ahead.PAUSE)]
    assert not any(paused) and c.ahead_misses == 0 and c.ahead_kinds is None
    assert ahead.due(c)


# ---------------------------------------------------------------- genai decode, bit for bit
og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install .[genai])")


def _steps(model, logits: list, tokens: list) -> None:
    """Two generators on one session with prompts of one length, stepped in blocks of five (the call made
    ahead for one is offered to the other at the same length), then one rewound and continued."""
    from test_compiled_genai import MAX_LENGTH, mg
    params = mg.search_options(model, MAX_LENGTH, 0)
    gens = [og.Generator(model, params) for _ in range(2)]
    gens[0].append_tokens(np.asarray([510, 5, 17, 33, 90, 12, 7], np.int32))
    gens[1].append_tokens(np.asarray([510, 44, 45, 46, 47, 48, 9], np.int32))

    def step(g):
        g.generate_next_token()
        tokens.append(int(g.get_next_tokens()[0]))
        lg = np.array(g.get_output("logits"))
        logits.append(lg.reshape(-1, lg.shape[-1])[-1].copy())
    for block in range(6):
        for _ in range(5):
            step(gens[block % 2])
    gens[0].rewind_to(12)
    gens[0].append_tokens(np.asarray([300, 301], np.int32))
    for _ in range(8):
        step(gens[0])


@pytest.mark.genai
def test_decode_made_ahead_gives_the_same_logits_bit_for_bit(monkeypatch):
    import ortmlx.compiled as C
    from test_compiled_genai import SHARE, mg, model_dir
    path = model_dir("qwen2")
    got = {}
    for on in ("0", "1"):
        logits, tokens = [], []
        with C.capture() as rs:
            model, _ = mg.load_model(path, "mlx", {"tuning": f"call_ahead={on}"}, SHARE)
        _steps(model, logits, tokens)
        counters = [dict(p.counters) for r in rs for p in r.parts()]
        del model
        got[on] = (np.stack(logits), tokens, counters)
    (off, toks_off, c_off), (on, toks_on, c_on) = got["0"], got["1"]
    assert toks_on == toks_off and len(toks_on) == 38
    assert off.tobytes() == on.tobytes()
    assert sum(c["ahead_calls"] for c in c_off) == 0
    made = sum(c["ahead_calls"] for c in c_on)
    missed = sum(c["ahead_misses"] for c in c_on)
    assert made >= 15 and missed >= 3, c_on              # every block's steady calls; each switch a miss
    assert not any(c["poisoned"] for c in c_on), c_on


def _greedy_logits(model, n: int = 12) -> np.ndarray:
    from test_compiled_genai import MAX_LENGTH, mg
    g = og.Generator(model, mg.search_options(model, MAX_LENGTH, 0))
    g.append_tokens(np.asarray([510, 5, 17, 33, 90, 12, 7], np.int32))
    rows = []
    for _ in range(n):
        g.generate_next_token()
        lg = np.array(g.get_output("logits"))
        rows.append(lg.reshape(-1, lg.shape[-1])[-1].copy())
    return np.stack(rows)


@pytest.mark.genai
@pytest.mark.parametrize("failure", ["error", "retrace"])
def test_a_failing_call_ahead_never_changes_an_answer(monkeypatch, failure):
    """An error while making the call ahead turns calls ahead off for the runner (the closure stays); a call
    ahead that traced the closure again poisons it (the trace set the closure's state): both answer as before."""
    import ortmlx.compiled as C
    from test_compiled_genai import SHARE, mg, model_dir
    path = model_dir("qwen2")
    model, _ = mg.load_model(path, "mlx", {"tuning": "call_ahead=0"}, SHARE)
    want = _greedy_logits(model)
    del model
    real = ahead.prepare

    def broken(kinds, host, dev, outs, types):
        if failure == "error":
            raise RuntimeError("made to fail")
        nxt, views = real(kinds, host, dev, outs, types)
        k = next(k for k, kind in enumerate(kinds) if kind >= 0)
        return nxt[:k] + [nxt[k].astype(mx.float16 if nxt[k].dtype != mx.float16 else mx.float32)] + nxt[k + 1:], \
            views

    monkeypatch.setattr(ahead, "prepare", broken)
    with C.capture() as rs:
        model, _ = mg.load_model(path, "mlx", {"tuning": "call_ahead=1"}, SHARE)
    got = _greedy_logits(model)
    (att,) = [r for r in rs if hasattr(r, "decode")]
    dec = att.decode
    poisoned, on, counters = [c.poisoned for c in dec.closures()], dec._ahead, dict(dec.counters)
    del model
    assert got.tobytes() == want.tobytes()
    assert counters["ahead_calls"] == 0
    if failure == "error":
        assert not on and not any(poisoned), (on, poisoned)
    else:
        assert any(p and "traced the closure again" in p for p in poisoned), poisoned

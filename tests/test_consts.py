"""kernels/consts.py: ranges and constant casts made once, never for non-constants."""
from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels import build, consts, cuda_kernels


def test_arange_is_cached_and_right():
    a = consts.arange(7)
    assert a is consts.arange(7)
    assert np.asarray(a).tolist() == list(range(7)) and a.dtype == mx.int32
    b = consts.arange(3, mx.int64, 5)
    assert np.asarray(b).tolist() == [5, 6, 7] and b.dtype == mx.int64
    with pytest.raises(ValueError, match="negative"):
        consts.arange(-1)


def test_zeros_is_cached_evaluated_and_a_constant_in_a_trace():
    z = consts.zeros((1,), mx.float16)
    assert z is consts.zeros((1,), mx.float16) and z is not consts.zeros((1,), mx.float32)
    assert z.dtype == mx.float16 and z.shape == (1,) and np.array(z).tolist() == [0.0]
    assert consts.zeros((3,), mx.int32).tolist() == [0, 0, 0]
    made = mx.compile(lambda x: mx.exp(mx.where(x > 0, x, mx.zeros((1,), x.dtype))))
    kept = mx.compile(lambda x: mx.exp(mx.where(x > 0, x, consts.zeros((1,), x.dtype))))
    x = mx.array([-1.0, 2.0])
    assert "Full" in _primitives(made(x))          # a fill kernel every call
    assert "Full" not in _primitives(kept(x))      # a constant of the trace
    for v in (x, mx.array([3.0, -4.0]), mx.array([-5.0, -6.0])):         # the same answers, bit for bit
        assert np.array(kept(v)).tolist() == np.array(made(v)).tolist()
    assert np.array(kept(x))[0] == 1.0


@pytest.mark.parametrize("value,dtype", [(0.0, mx.float16), (-2.5, mx.float32), (7, mx.int32), (True, mx.bool_),
                                         (-3, mx.int64), (200, mx.uint8)])
def test_small_constants_are_roomy_views(value, dtype):
    """Arrays of 8 bytes or less come back as other (evaluated) arrays of the same values, shape and type: views
    into 16 bytes a kernel wrote (MLX's CUDA allocator pools the small ones in managed memory); larger ones as
    they are."""
    for shape in ((), (1,), (1, 1)):
        a = mx.full(shape, value, dtype)
        if a.nbytes > consts.POOLED_BYTES:
            continue
        r = consts.roomy(a)
        assert r is not a and r.shape == shape and r.dtype == dtype
        assert np.array_equal(np.array(r), np.array(a))
    two = mx.full((2,), value, dtype)
    if two.nbytes <= consts.POOLED_BYTES:
        assert np.array(consts.roomy(two)).tolist() == np.array(two).tolist()
    big = mx.full((4,), value, mx.float32)
    assert consts.roomy(big) is big
    s = consts.scalar(value, dtype)
    assert s is consts.scalar(value, dtype) and s.shape == () and s.dtype == dtype and s.item() == np.array(
        mx.array(value, dtype)).item()
    z = consts.zeros((1,), dtype)
    assert z.shape == (1,) and z.dtype == dtype and np.array(z).tolist() == [0]


def _primitives(out) -> list[str]:
    import re
    import tempfile
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        return [lab.split()[0] for lab in re.findall(r'label ="([^"]*)"', open(f.name).read())]


def test_cast_memoises_registered_constants_only():
    c = mx.array(np.arange(6, dtype=np.float16))
    mx.eval(c)
    other = mx.array(np.arange(6, dtype=np.float16))
    consts.register([c])
    f1, f2 = consts.cast(c, mx.float32), consts.cast(c, mx.float32)
    assert f1 is f2 and f1.dtype == mx.float32 and np.asarray(f1).tolist() == list(range(6))
    assert consts.cast(other, mx.float32) is not consts.cast(other, mx.float32)     # not a constant
    assert consts.cast(c, mx.float16) is c and consts.cast(None, mx.float32) is None


def test_cast_entry_dies_with_its_constant():
    c = mx.array(np.ones(4, np.float16))
    consts.register([c])
    key = id(c)
    assert key in consts._CONSTS
    del c
    gc.collect()
    assert key not in consts._CONSTS or consts._CONSTS[key][0]() is not None


def test_constant_dying_inside_register_does_not_deadlock():
    """A registered constant collected while ``register`` holds the lock (a collection its own allocations
    ran) forgets itself on the same thread: that must not wait for the lock it holds (it did: a hang seen
    in the suite). Run in a thread so that a regression fails here instead of hanging."""
    import threading
    c = mx.array(np.ones(3, np.float16))
    consts.register([c])
    key, ref = id(c), consts._CONSTS[id(c)][0]
    done = []

    def inside():
        with consts._lock:
            consts._forget(key, ref)        # what the weak reference's callback does
            done.append(key not in consts._CONSTS)
    t = threading.Thread(target=inside, daemon=True)
    t.start()
    t.join(10)
    assert done == [True], "forget waited for the lock its own thread holds"


def test_big_constants_are_not_kept():
    c = mx.zeros((consts.CAST_MAX_ELEMS + 1,), mx.float16)
    consts.register([c])
    assert consts.cast(c, mx.float32) is not consts.cast(c, mx.float32)


def test_memo_is_scoped_to_one_build():
    calls = []

    def make():
        calls.append(1)
        return len(calls)
    assert build.memo(("k",), make) == 1 and build.memo(("k",), make) == 2       # no build: every time
    with build.active(build.BuildContext()):
        assert build.memo(("k",), make) == 3 and build.memo(("k",), make) == 3
        with build.active(build.BuildContext()):                               # a nested body's build
            assert build.memo(("k",), make) == 4
        assert build.memo(("k",), make) == 3
    assert build.memo(("k",), make) == 5



def test_small_lengths_are_unpooled_in_builds_that_ask():
    """A length computed from an array of 8 bytes or less comes out of an elementwise kernel over it plus 16 bytes of
    zeros, seen through its first row (its values, shape and type), traced too; as it is outside such a build, in a
    shapeless trace, and from larger arrays."""
    lens = mx.array([6], mx.int32)
    inc = lambda x: x + 1                                            # noqa: E731
    assert np.array(consts.unpooled(inc, lens)).tolist() == [7]     # no build: fn(a)
    calls = []
    with build.active(build.BuildContext(unpooled=True)):
        u = consts.unpooled(lambda x: calls.append(x.shape) or x + 1, lens)
        assert calls == [(4, 1)]
        assert u.shape == (1,) and u.dtype == mx.int32 and np.array(u).tolist() == [7]
        pair = mx.array([3, 4], mx.int16)
        assert np.array(consts.unpooled(lambda x: x - 1, pair)).tolist() == [2, 3]
        big = mx.array([1, 2, 3], mx.int32)
        calls.clear()
        assert np.array(consts.unpooled(lambda x: calls.append(x.shape) or x * 2, big)).tolist() == [2, 4, 6]
        assert calls == [(3,)]
        traced = mx.compile(lambda a: consts.unpooled(inc, a) * 2)
        assert np.array(traced(mx.array([5], mx.int32))).tolist() == [12]
        assert np.array(traced(mx.array([9], mx.int32))).tolist() == [20]
    with build.active(build.BuildContext(unpooled=True, shapeless=True)):
        calls.clear()
        assert np.array(consts.unpooled(lambda x: calls.append(x.shape) or x + 1, lens)).tolist() == [7]
        assert calls == [(1,)]
    from ortmlx.kernels.passes import BuildConfig
    from ortmlx.tuning import Tuning
    assert BuildConfig.for_device("gpu").context().unpooled
    assert not BuildConfig.for_device("cpu").context().unpooled
    assert not BuildConfig.for_device("gpu", Tuning.parse("unpooled_lengths=0")).context().unpooled


def test_roomy_all_replaces_the_small_ones_in_one_go():
    arrays = {"eps": mx.array(1e-5, mx.float32), "half": mx.array([0.5], mx.float16),
              "pair": mx.array([1, 2], mx.int32), "gamma": mx.ones((4,), mx.float32), "big": mx.arange(10)}
    before = dict(arrays)
    assert consts.roomy_all(arrays) == 3
    for k in ("eps", "half", "pair"):
        assert arrays[k] is not before[k] and arrays[k].shape == before[k].shape and arrays[k].dtype == before[k].dtype
        assert np.array_equal(np.array(arrays[k]), np.array(before[k]))
    assert arrays["gamma"] is before["gamma"] and arrays["big"] is before["big"]


@pytest.mark.skipif(not cuda_kernels.cuda_backend(), reason="needs MLX's CUDA backend")
def test_scalar_constants_on_the_gpu_answer_as_the_cpu_ep():
    """A graph's scalar initializers (views into 16 device bytes on a GPU) in fused elementwise work and a Clip."""
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    from ortmlx.testing import make_model, session
    nodes = [helper.make_node("Mul", ["x", "half"], ["a"]), helper.make_node("Add", ["a", "one"], ["b"]),
             helper.make_node("Clip", ["b", "lo", "hi"], ["y"])]
    inits = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
             (("half", 0.5), ("one", 1.0), ("lo", 0.0), ("hi", 6.0))]
    m = make_model(nodes, [("x", T.FLOAT, [2, 3000])], [("y", T.FLOAT, [2, 3000])], initializers=inits)
    x = (np.random.default_rng(3).standard_normal((2, 3000)) * 8).astype(np.float32)
    want = session(m, "CPUExecutionProvider", record=False).run(None, {"x": x})[0]
    for opts in ({"device": "gpu"}, {"device": "gpu", "no_compile": "1"}):
        got = session(m, options=opts).run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, want)


def _held_bytes(make, n: int = 64) -> float:
    """The bytes of MLX memory each of ``n`` kept results of ``make(i)`` holds."""
    keep = []
    mx.synchronize()
    m0 = mx.get_active_memory()
    for i in range(n):
        r = make(i)
        mx.eval(r)
        keep.append(r)
    mx.synchronize()
    return (mx.get_active_memory() - m0) / n


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("batch", [1, 2])
def test_unpooled_lengths_hold_a_whole_buffer(batch, compiled):
    """An unpooled length is a view into at least ``ROOM_BYTES`` (a result of 8 bytes or less is what MLX's CUDA
    allocator pools): neither a gather of its first row nor an elementwise result sized as a broadcast input."""
    inc = lambda x: x + 1                                            # noqa: E731
    f = mx.compile(lambda a: consts.unpooled(inc, a)) if compiled else (lambda a: consts.unpooled(inc, a))
    with build.active(build.BuildContext(unpooled=True)):
        lens = [mx.array([i + 5] * batch, mx.int32) for i in range(64)]
        mx.eval(*lens)
        held = _held_bytes(lambda i: f(lens[i]))
        assert np.array(f(lens[3])).tolist() == [9] * batch
    assert held >= consts.ROOM_BYTES


@pytest.mark.parametrize("value, dtype", [(0.5, mx.float32), (3, mx.int64), (1, mx.int8)])
def test_roomy_constants_hold_a_whole_buffer(value, dtype):
    """A roomy constant of 8 bytes or less is a view into at least ``ROOM_BYTES``, out of MLX's pool of small
    arrays."""
    held = _held_bytes(lambda i: consts.roomy(mx.array(value, dtype) + mx.array(i % 2, dtype)))
    assert held >= consts.ROOM_BYTES

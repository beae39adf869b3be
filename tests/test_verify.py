"""verify-then-trust's comparison (``compiled/verify.py``): float reassociation passes, a wrong closure does not.

Every case runs both ways: host arrays through NumPy, and MLX arrays through the device comparison (on MLX's CPU
here, chunked small so several chunks run); both must give the same verdict and the same kind of reason."""
import mlx.core as mx
import numpy as np
import pytest

from ortmlx.compiled import verify
from ortmlx.compiled.verify import mismatch as host_mismatch


def mismatch(got, want, bf16=frozenset()):
    """The host verdict, after checking the device path agrees with it."""
    host = host_mismatch(got, want, bf16)
    old = verify.CHUNK
    verify.CHUNK = 1000                                # several chunks, and a ragged last one
    try:
        dev = host_mismatch([mx.array(g) for g in got], [mx.array(w) for w in want], device=mx.cpu, device_min=0)
    finally:
        verify.CHUNK = old
    assert (host is None) == (dev is None), (host, dev)
    if host is not None:
        assert host.split(":")[0] == dev.split(":")[0], (host, dev)        # the output's index
        for kind in ("NaN positions differ", "differ beyond rtol", "elements differ (first at flat"):
            assert (kind in host) == (kind in dev), (host, dev)
    return host


def _product(order: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """A float32 product summed in two orders (what a fused or padded closure may do), and elements that cancel."""
    a = (30 * rng.standard_normal((16, 512))).astype(np.float32)
    b = rng.standard_normal((512, 64)).astype(np.float32)
    # four columns orthogonal to a's rows (in float64): their float32 products are rounding noise only, on any BLAS
    a64 = a.astype(np.float64)
    c = rng.standard_normal((512, 4))
    b[:, :4] = c - a64.T @ np.linalg.solve(a64 @ a64.T, a64 @ c)
    want = a @ b
    if order == "blocked":
        got = sum(a[:, k:k + 7] @ b[k:k + 7] for k in range(0, 512, 7)).astype(np.float32)
    else:
        got = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    return got, want


@pytest.mark.parametrize("order", ["blocked", "float64"])
def test_reassociated_sums_match(order):
    got, want = _product(order, np.random.default_rng(0))
    assert not np.array_equal(got, want)                       # they do differ ...
    assert (np.abs(got - want) > 1e-5 + 1e-4 * np.abs(want)).any()     # ... beyond rtol and atol somewhere, yet:
    assert mismatch([got], [want]) is None


@pytest.mark.parametrize("wrong", ["row", "element", "stale", "sign", "scaled"])
def test_wrong_closures_are_caught(wrong):
    rng = np.random.default_rng(1)
    _, want = _product("float64", rng)
    got = want.copy()
    scale = float(np.sqrt(np.mean(want.astype(np.float64) ** 2)))
    if wrong == "row":              # a row past the traced ones computed wrongly
        got[-1] = rng.standard_normal(got.shape[1]).astype(np.float32) * scale
    elif wrong == "element":        # one element off by 1e-3 of the output's scale
        got[3, 10] += 1e-3 * scale
    elif wrong == "stale":          # last call's values in one row
        got[5] = want[4]
    elif wrong == "sign":
        got[:, 7] = -got[:, 7]
    else:                           # a baked divisor: every value 1% off
        got *= 1.01
    why = mismatch([got], [want])
    assert why is not None and "differ beyond rtol" in why, why


@pytest.mark.parametrize("wrong", [False, True])
def test_empty_rows_do_not_shrink_the_scale(wrong):
    """A KV buffer a prompt filled 100 of 4,104 rows of: rounding in the filled rows at 5e-5 of their RMS
    (a 24-layer float32 prefill moved one element by that much) passes; a wrong value there does not."""
    rng = np.random.default_rng(3)
    want = np.zeros((2, 4104, 16), np.float32)
    want[:, :100] = rng.standard_normal((2, 100, 16)).astype(np.float32)
    got = want.copy()
    k = np.unravel_index(np.argmin(np.abs(want[:, :100])), (2, 100, 16))    # a small element: its own rtol is tight
    got[k] += 2e-2 if wrong else 5e-5
    why = mismatch([got], [want])
    assert (why is not None and "differ beyond rtol" in why) if wrong else why is None, why


@pytest.mark.parametrize("wrong", ["none", "row", "element", "stale", "sign", "scaled"])
def test_float16_rounding_passes_and_wrong_closures_do_not(wrong):
    """float16: each element moved by a few ulps (5e-3 of the RMS: what a fused kernel's float32 intermediates do
    against eager's float16 ones) passes; the wrong closures above, at float16's scale, do not."""
    rng = np.random.default_rng(4)
    want = (2.5 * rng.standard_normal((100, 512))).astype(np.float16)
    w32 = want.astype(np.float32)
    scale = float(np.sqrt(np.mean(w32.astype(np.float64) ** 2)))
    got = (w32 + 5e-3 * scale * rng.choice([-1.0, 1.0], want.shape)).astype(np.float16)
    if wrong == "row":
        got[-1] = (rng.standard_normal(512) * scale).astype(np.float16)
    elif wrong == "element":        # one element off by 6e-2 of the scale (a deep graph drifts some by ~2e-2)
        got[3, 10] = np.float16(w32[3, 10] + 6e-2 * scale)
    elif wrong == "stale":
        got[5] = want[4]
    elif wrong == "sign":
        got[:, 7] = -got[:, 7]
    elif wrong == "scaled":         # every value 1% off
        got = (w32 * 1.01).astype(np.float16)
    why = mismatch([got], [want])
    assert why is None if wrong == "none" else (why is not None and "differ beyond rtol" in why), why


def _kv_drift(rng, dtype=np.float32):
    """A KV output a prompt filled 100 of 4,104 rows of (float64), its scale, and the filled rows' mask."""
    want = np.zeros((2, 4104, 64))
    want[:, :100] = 9 * rng.standard_normal((2, 100, 64))
    want = want.astype(dtype).astype(np.float64)
    filled = want != 0
    scale = float(np.sqrt(np.mean(want[filled] ** 2)))
    return want, scale, filled


@pytest.mark.parametrize("case", ["drift", "row_off", "row_rescaled", "column_shift", "empty_row_filled",
                                  "single_far", "noisy", "scaled", "float32"])
def test_a_deep_half_graphs_drift_passes_as_a_whole(case):
    """A 24-layer float16 prompt closure left up to 557 of 525,312 KV elements beyond 1e-2 of their RMS off eager
    (the furthest 2.3e-2, the differences' RMS 4.9e-3), scattered over the rows: such drift passes in half
    precision. A row 4e-2 off or rescaled by 3%, a column shifted by 9e-2, an empty row filled with +-3e-2 of the
    scale, one element 6e-2 off, +-2.5e-2 everywhere, a 0.4% rescale, or the drift in float32, do not."""
    rng = np.random.default_rng(7)
    dtype = np.float32 if case == "float32" else np.float16
    want, scale, filled = _kv_drift(rng, dtype)
    noise = 4e-3 * rng.standard_normal(want.shape) if case != "noisy" else 2.5e-2 * rng.choice([-1, 1], want.shape)
    got = want + np.where(filled, noise * scale, 0)
    if case in ("drift", "float32"):                  # 4% of the filled elements 2.3e-2 of the scale off
        at = np.flatnonzero(filled.reshape(-1) & (rng.random(want.size) < 0.04))
        got.reshape(-1)[at] += 2.3e-2 * scale * np.sign(want.reshape(-1)[at])
    elif case == "row_off":
        got[0, 37] += 4e-2 * scale
    elif case == "row_rescaled":
        got[1, 99] = want[1, 99] * 1.03
    elif case == "column_shift":
        got[0, :100, 5] += 9e-2 * scale
    elif case == "empty_row_filled":
        got[0, 100] = 3e-2 * scale * rng.choice([-1, 1], 64)
    elif case == "single_far":
        got[1, 3, 7] += 6e-2 * scale
    elif case == "scaled":
        got = want * 1.004
    why = mismatch([got.astype(dtype)], [want.astype(dtype)])
    assert why is None if case == "drift" else (why is not None and "differ beyond rtol" in why), (case, why)
    if why is not None:
        assert "the furthest by" in why and "the least-squares factor" in why


@pytest.mark.parametrize("wrong", [False, True])
def test_bf16_drift_passes_as_a_whole_and_a_wrong_row_does_not(wrong):
    rng = np.random.default_rng(8)
    want, scale, filled = _kv_drift(rng)
    got = want + np.where(filled, 1e-2 * scale * rng.standard_normal(want.shape), 0)
    if wrong:
        got[0, 50] += 0.15 * scale
    w = mx.array(want.astype(np.float32)).astype(mx.bfloat16)
    g = mx.array(got.astype(np.float32)).astype(mx.bfloat16)
    dev = host_mismatch([g], [w], device=mx.cpu, device_min=0)
    host = host_mismatch([verify.dt.host(g)], [verify.dt.host(w)], bf16=frozenset({0}))
    assert (dev is None) == (host is None) == (not wrong), (dev, host)


def test_nan_positions_and_integers():
    w = np.array([1.0, np.nan, 3.0], np.float32)
    assert mismatch([w.copy()], [w]) is None
    assert "NaN positions differ" in mismatch([np.array([1.0, 2.0, 3.0], np.float32)], [w])
    i = np.arange(6, dtype=np.int64)
    j = i.copy()
    j[2] += 1
    assert "1 elements differ" in mismatch([j], [i])


def test_infinities_bf16_and_large_values():
    w = np.array([1.0, np.inf, -np.inf, 3.0] * 300, np.float32)
    assert mismatch([w.copy()], [w]) is None
    g = w.copy()
    g[1] = 1e30                                        # inf against a finite value: never close
    assert "differ beyond rtol" in mismatch([g], [w])
    g = w.copy()
    g[2] = np.inf                                      # the other infinity
    assert "differ beyond rtol" in mismatch([g], [w])
    big = np.full(5000, 3e30, np.float32)              # squares overflow float32: the scale is still 3e30
    big[7] *= 1.001                                    # 1e-3 of the value and of the scale: past both
    assert "differ beyond rtol" in mismatch([big], [np.full(5000, 3e30, np.float32)])
    near = np.full(5000, 3e30, np.float32)
    near[7] *= 1 + 5e-5                                # within rtol 1e-4
    assert mismatch([near], [np.full(5000, 3e30, np.float32)]) is None


def test_device_scale_is_the_host_scale():
    """The device RMS (float32 partial sums of 4,096, added in float64) is NumPy's float64 RMS to 1e-5."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(1 << 20) * 3).astype(np.float32)
    g = w.copy()
    g[::97] += 0.05                                    # past rtol and 1e-4 of the RMS: the RMS is printed
    host, dev = host_mismatch([g], [w]), host_mismatch([mx.array(g)], [mx.array(w)], device=mx.cpu, device_min=0)
    rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
    h_rms = float(host.split("nonzero RMS ")[1].split(",")[0])
    d_rms = float(dev.split("nonzero RMS ")[1].split(",")[0])
    assert abs(h_rms - rms) < 1e-2 * rms and d_rms == h_rms, (host, dev)
    assert host.split(" of ")[0] == dev.split(" of ")[0]                # the same count of elements


def test_bf16_outputs_on_the_device():
    rng = np.random.default_rng(6)
    w = mx.array(rng.standard_normal(4000).astype(np.float32)).astype(mx.bfloat16)
    g = w + mx.array(np.where(np.arange(4000) == 11, 1.0, 0.0).astype(np.float32)).astype(mx.bfloat16)
    assert host_mismatch([w], [w], device=mx.cpu, device_min=0) is None
    why = host_mismatch([g], [w], device=mx.cpu, device_min=0)
    assert why is not None and "flat 11" in why, why
    hb = [verify.dt.host(g)], [verify.dt.host(w)]                      # the host path: uint16 bits
    assert "flat 11" in host_mismatch(*hb, bf16=frozenset({0}))

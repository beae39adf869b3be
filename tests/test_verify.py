"""verify-then-trust's comparison (``compiled/verify.py``): float reassociation passes, a wrong closure does not."""
import numpy as np
import pytest

from ortmlx.compiled.verify import mismatch


def _product(order: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """A float32 product summed in two orders (what a fused or padded closure may do), and elements that cancel."""
    a = (30 * rng.standard_normal((16, 512))).astype(np.float32)
    b = rng.standard_normal((512, 64)).astype(np.float32)
    b[:, :4] = -np.roll(b[:, :4], 1, axis=0) + 1e-3 * rng.standard_normal((512, 4)).astype(np.float32)
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


def test_nan_positions_and_integers():
    w = np.array([1.0, np.nan, 3.0], np.float32)
    assert mismatch([w.copy()], [w]) is None
    assert "NaN positions differ" in mismatch([np.array([1.0, 2.0, 3.0], np.float32)], [w])
    i = np.arange(6, dtype=np.int64)
    j = i.copy()
    j[2] += 1
    assert "1 elements differ" in mismatch([j], [i])

"""The row-making product kernels (``ortmlx/kernels/cuda_rows.py``) on MLX's CUDA backend: against their
float32 contract, and bit for bit against the kernels whose rows they make (an identity weight multiplies
by one and adds zeros: exact). Skipped without a CUDA GPU (``test_rowfold.py`` covers the wiring everywhere)."""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels import build, cuda_kernels, cuda_rows

pytestmark = pytest.mark.skipif(not cuda_kernels.cuda_backend(), reason="needs MLX's CUDA backend")

TOL = {mx.float16: 2e-3, mx.bfloat16: 1.6e-2, mx.float32: 1e-5}
DTYPES = pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=["fp16", "bf16", "fp32"])


def _weight(w: np.ndarray, dtype, lifted: bool):
    """``w`` [K, N] as ``dtypes.device_copies`` stores a MatMul weight: column-major (lifted: [1, K, N])."""
    a = mx.array(w.astype(np.float32)).astype(dtype)
    if lifted:
        a = a.reshape((1,) + a.shape)
    a = mx.contiguous(a.swapaxes(-1, -2)).swapaxes(-1, -2)
    mx.eval(a)
    cuda_rows.register_col_major([a])
    return a


def _picking(rng, k: int, most: int, dtype):
    """(idx, w): up to ``most`` random columns of K, and a column-major weight with one 1 a column at those rows (a
    product with it picks the rows' elements: exact)."""
    idx = rng.permutation(k)[:min(k, most)]
    pick = np.zeros((k, idx.size))
    pick[idx, np.arange(idx.size)] = 1.0
    return idx, _weight(pick, dtype, False)


def _f32(a) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float32)


def _close(got, want, dtype, k: int, what: str) -> None:
    """float32 sums in another order, one rounding: within an ulp of the type, plus the sums' spread."""
    tol = TOL[dtype]
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=tol, atol=tol * math.sqrt(k), err_msg=what)


# (K, N, skip, bias, lifted, lead): a 0.5B QKV, a 1.5B gate/up (TPR 64, 1024 threads), K not a multiple of 8
NORM_CASES = [(896, 1152, True, False, True, (1, 1)), (1536, 17920, True, True, True, (1, 1)),
              (100, 24, False, False, False, (1,)), (896, 32000, False, False, True, (1, 1))]


@DTYPES
@pytest.mark.parametrize("k,n,skip,bias,lifted,lead", NORM_CASES,
                         ids=[f"K{c[0]} N{c[1]}{' skip' if c[2] else ''}{' bias' if c[3] else ''}" for c in NORM_CASES])
def test_norm_gemv(k, n, skip, bias, lifted, lead, dtype):
    if k * dtype.size > cuda_rows.ROW_MAX_BYTES:
        pytest.skip("row beyond shared memory: not a case of the kernel (row_reason)")
    rng = np.random.default_rng(k + n)
    with mx.stream(mx.gpu):
        x, s = (mx.array(rng.standard_normal(lead + (k,)).astype(np.float32)).astype(dtype) for _ in range(2))
        gamma, b = (mx.array(rng.standard_normal(k).astype(np.float32)).astype(dtype) for _ in range(2))
        w = _weight(rng.standard_normal((k, n)) * 0.05, dtype, lifted)
        skip_, bias_ = (s if skip else None), (b if bias else None)
        assert cuda_rows.row_reason(x, w, k) is None
        y, total = cuda_rows.norm_gemv(x, gamma, 1e-6, w, skip_, bias_)
        row, want_total = cuda_kernels.rms_norm(x, gamma, 1e-6, skip=skip_, bias=bias_)
        want = mx.matmul(row.astype(mx.float32), w.reshape(k, n).astype(mx.float32)).astype(dtype)
        mx.eval(y, want, *(a for a in (total, want_total) if a is not None))
    assert y.shape == lead + (n,) and y.dtype == dtype
    _close(y, want, dtype, k, "row @ w")
    if skip:
        np.testing.assert_array_equal(_f32(total), _f32(want_total))        # the same sum, the same rounding
    else:
        assert total is None


@DTYPES
@pytest.mark.parametrize("k", [896, 100, 1536])
def test_norm_row_is_rms_norms_row(k, dtype):
    """An identity weight gives the row itself: the norm made inside equals ``rms_norm``'s, bit for bit."""
    rng = np.random.default_rng(k)
    with mx.stream(mx.gpu):
        x, s = (mx.array(rng.standard_normal((1, 1, k)).astype(np.float32) * 3).astype(dtype) for _ in range(2))
        gamma = mx.array(rng.standard_normal(k).astype(np.float32)).astype(dtype)
        w = _weight(np.eye(k), dtype, True)
        y, _ = cuda_rows.norm_gemv(x, gamma, 1e-6, w, s)
        row, _ = cuda_kernels.rms_norm(x, gamma, 1e-6, skip=s)
        strided = mx.array(rng.standard_normal((1, 1, 2 * k)).astype(np.float32)).astype(dtype)[..., ::2]
        y2, _ = cuda_rows.norm_gemv(strided, gamma, 1e-5, w)               # a row with element stride 2
        row2, _ = cuda_kernels.rms_norm(mx.contiguous(strided), gamma, 1e-5)
        mx.eval(y, row, y2, row2)
    np.testing.assert_array_equal(_f32(y), _f32(row))
    np.testing.assert_array_equal(_f32(y2), _f32(row2))


SWIGLU_CASES = [(4864, 896, True), (8960, 1536, False), (36, 40, True), (1000, 3000, False)]


@DTYPES
@pytest.mark.parametrize("k,n,gate_first", SWIGLU_CASES, ids=[f"K{k} N{n}" for k, n, _ in SWIGLU_CASES])
def test_swiglu_gemv(k, n, gate_first, dtype):
    if k * dtype.size > cuda_rows.ROW_MAX_BYTES:
        pytest.skip("row beyond shared memory: not a case of the kernel (row_reason)")
    rng = np.random.default_rng(k * 3 + n)
    with mx.stream(mx.gpu):
        y = mx.array((rng.standard_normal((1, 1, 2 * k)) * 3).astype(np.float32)).astype(dtype)
        w = _weight(rng.standard_normal((k, n)) * 0.05, dtype, True)
        assert cuda_rows.row_reason(y, w, k) is None
        got = cuda_rows.swiglu_gemv(y, w, k, gate_first)
        row = cuda_kernels.swiglu(y, k, gate_first)
        want = mx.matmul(row.astype(mx.float32), w.reshape(k, n).astype(mx.float32)).astype(dtype)
        mx.eval(got, want)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    _close(got, want, dtype, k, "gating @ w")


@DTYPES
@pytest.mark.parametrize("gate_first", [True, False])
def test_swiglu_row_is_swiglus_row(gate_first, dtype):
    """An identity weight gives the row itself: the gating made inside equals ``swiglu``'s, bit for bit,
    also for a merged row read with element stride 2."""
    k = 1000
    rng = np.random.default_rng(11)
    with mx.stream(mx.gpu):
        y = mx.array((rng.standard_normal((1, 1, 2 * k)) * 4).astype(np.float32)).astype(dtype)
        w = _weight(np.eye(k), dtype, False)
        got, want = cuda_rows.swiglu_gemv(y, w, k, gate_first), cuda_kernels.swiglu(y, k, gate_first)
        wide = mx.array((rng.standard_normal((1, 1, 4 * k)) * 4).astype(np.float32)).astype(dtype)[..., ::2]
        got2, want2 = cuda_rows.swiglu_gemv(wide, w, k, gate_first), cuda_kernels.swiglu(mx.contiguous(wide), k,
                                                                                          gate_first)
        mx.eval(got, want, got2, want2)
    np.testing.assert_array_equal(_f32(got), _f32(want))
    np.testing.assert_array_equal(_f32(got2), _f32(want2))


# (K, width, gate_first, skip, bias): a 0.5B and a 1.5B gate/up, a K of element loads (not 16-byte pieces)
GATED_CASES = [(896, 4864, True, True, False), (1536, 8960, False, True, True), (100, 12, True, False, False)]


@DTYPES
@pytest.mark.parametrize("k,width,gate_first,skip,bias", GATED_CASES, ids=[f"K{c[0]} W{c[1]}" for c in GATED_CASES])
def test_norm_gemv_gated_is_swiglu_of_the_product(k, width, gate_first, skip, bias, dtype):
    """The gate/up product made gated (``gating=``) equals ``swiglu`` of the plain product, bit for bit: the
    same sums in the same order, each rounded, then gated with swiglu's roundings; the sum output too."""
    rng = np.random.default_rng(k + width)
    with mx.stream(mx.gpu):
        x, s = (mx.array(rng.standard_normal((1, 1, k)).astype(np.float32)).astype(dtype) for _ in range(2))
        gamma, b = (mx.array(rng.standard_normal(k).astype(np.float32)).astype(dtype) for _ in range(2))
        w = _weight(rng.standard_normal((k, 2 * width)) * 0.1, dtype, True)
        skip_, bias_ = (s if skip else None), (b if bias else None)
        got, got_total = cuda_rows.norm_gemv(x, gamma, 1e-6, w, skip_, bias_, gating=(width, gate_first))
        y, total = cuda_rows.norm_gemv(x, gamma, 1e-6, w, skip_, bias_)
        want = cuda_kernels.swiglu(y, width, gate_first)
        mx.eval(got, want, *(a for a in (got_total, total) if a is not None))
    assert got.shape == (1, 1, width) and got.dtype == dtype
    np.testing.assert_array_equal(_f32(got), _f32(want))
    if skip:
        np.testing.assert_array_equal(_f32(got_total), _f32(total))
    with pytest.raises(ValueError, match="width"):
        cuda_rows.norm_gemv(x, gamma, 1e-6, w, gating=(width + 1, gate_first))


# (K, N): a 0.5B and a 1.5B down product, K not a multiple of 8
GEMV_CASES = [(4864, 896), (8960, 1536), (36, 40)]


@DTYPES
@pytest.mark.parametrize("k,n", GEMV_CASES, ids=[f"K{k} N{n}" for k, n in GEMV_CASES])
def test_gemv(k, n, dtype):
    """One row times a column-major weight against the float32 product; a weight of one 1 a column picks the
    row's elements bit for bit, also from a row read with element stride 2."""
    if k * dtype.size > cuda_rows.ROW_MAX_BYTES:
        pytest.skip("row beyond shared memory: not a case of the kernel (row_reason)")
    rng = np.random.default_rng(k * 5 + n)
    with mx.stream(mx.gpu):
        a = mx.array((rng.standard_normal((1, 1, k)) * 2).astype(np.float32)).astype(dtype)
        w = _weight(rng.standard_normal((k, n)) * 0.05, dtype, True)
        assert cuda_rows.row_reason(a, w, k) is None
        got = cuda_rows.gemv(a, w)
        want = mx.matmul(a.astype(mx.float32), w.reshape(k, n).astype(mx.float32)).astype(dtype)
        idx, pick = _picking(rng, k, 512, dtype)
        strided = mx.array((rng.standard_normal((1, 2 * k)) * 2).astype(np.float32)).astype(dtype)[..., ::2]
        back, back2 = cuda_rows.gemv(a, pick), cuda_rows.gemv(strided, pick)
        mx.eval(got, want, back, back2)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    _close(got, want, dtype, k, "a @ w")
    np.testing.assert_array_equal(_f32(back), _f32(a)[..., idx])
    np.testing.assert_array_equal(_f32(back2), _f32(strided)[..., idx])


def test_row_major_weight_takes_the_element_path():
    """A weight not column-major (registered anyway) is read through its strides: the same answer, slowly."""
    rng = np.random.default_rng(2)
    with mx.stream(mx.gpu):
        x = mx.array(rng.standard_normal((1, 1, 200)).astype(np.float32)).astype(mx.float16)
        gamma = mx.array(rng.standard_normal(200).astype(np.float32)).astype(mx.float16)
        w = mx.array((rng.standard_normal((200, 64)) * 0.05).astype(np.float32)).astype(mx.float16)
        cuda_rows.register_col_major([w])
        y, _ = cuda_rows.norm_gemv(x, gamma, 1e-6, w)
        row, _ = cuda_kernels.rms_norm(x, gamma, 1e-6)
        want = mx.matmul(row.astype(mx.float32), w.astype(mx.float32)).astype(mx.float16)
        mx.eval(y, want)
    _close(y, want, mx.float16, 200, "row-major weight")


@DTYPES
@pytest.mark.parametrize("lead", [(4, 1), (3, 2), (cuda_rows.ROWS_MAX, 1)], ids=["4x1", "3x2", "max"])
def test_rows_get_the_bits_each_row_gets_alone(lead, dtype):
    """A batch's rows (grid rows): every output of each row equals, bit for bit, the same kernel's on that row
    alone (norm with skip, bias and gating, the sum, swiglu, the plain product), also for rows read through
    strides (every other row of a larger array)."""
    k, width = 896, 4864
    rng = np.random.default_rng(sum(lead))
    def r(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    with mx.stream(mx.gpu), build.active(build.BuildContext(row_limit=cuda_rows.ROWS_MAX)):
        s = r(lead + (k,))
        gamma, b = r((k,)), r((k,))
        w_gu = _weight(rng.standard_normal((k, 2 * width)) * 0.05, dtype, True)
        w_d = _weight(rng.standard_normal((width, k)) * 0.05, dtype, True)
        for x in (r(lead + (k,)), r((2 * lead[0],) + lead[1:] + (k,))[::2]):
            assert cuda_rows.row_reason(x, w_gu, k) is None
            gated, total = cuda_rows.norm_gemv(x, gamma, 1e-6, w_gu, s, b, gating=(width, True))
            plain, _ = cuda_rows.norm_gemv(x, gamma, 1e-6, w_gu, s, b)
            down, sw = cuda_rows.gemv(gated, w_d), cuda_rows.swiglu_gemv(plain, w_d, width)
            outs = [gated, total, plain, down, sw]
            mx.eval(*outs)
            xf, sf = x.reshape(-1, k), s.reshape(-1, k)
            for i in range(xf.shape[0]):
                g1, t1 = cuda_rows.norm_gemv(xf[i:i + 1], gamma, 1e-6, w_gu, sf[i:i + 1], b, gating=(width, True))
                p1, _ = cuda_rows.norm_gemv(xf[i:i + 1], gamma, 1e-6, w_gu, sf[i:i + 1], b)
                alone = [g1, t1, p1, cuda_rows.gemv(g1, w_d), cuda_rows.swiglu_gemv(p1, w_d, width)]
                mx.eval(*alone)
                for name, many, one in zip(("gated", "sum", "plain", "down", "swiglu"), outs, alone):
                    assert many.shape[:-1] == lead
                    np.testing.assert_array_equal(_f32(many.reshape(-1, many.shape[-1])[i]), _f32(one[0]),
                                                  err_msg=f"{name}, row {i}")

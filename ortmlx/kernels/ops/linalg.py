"""Matrix products: MatMul, Gemm, Einsum (float types only: MLX has no integer matmul)."""
from __future__ import annotations

import mlx.core as mx

from .. import dtypes as dt
from .. import build, cuda_kernels, cuda_rows
from ..registry import register

FLOATS = dt.FLOATS


def _float_inputs(view, idx=(0, 1)):
    for i in idx:
        t = view.dtype(i)
        if view.has(i) and t is not None and t not in FLOATS:
            return f"input {i} is {dt.name(t)}: MLX has no integer matmul"
    return None


@register("MatMul", 1, dtypes=FLOATS, check=_float_inputs)
def matmul(A, B):
    """numpy.matmul semantics, including 1-D operands. Decode rows by a column-major weight take our row kernel
    where the build asks (``build.row_products``): float32 sums rounded once, as MLX's gemv."""
    if A.ndim >= B.ndim and build.row_products() and cuda_kernels.enabled() \
            and cuda_rows.row_reason(A, B, A.shape[-1]) is None:
        return cuda_rows.gemv(A, B)
    return mx.matmul(A, B)


def _gemm_check(view):
    reason = _float_inputs(view, (0, 1, 2))
    if reason:
        return reason
    for i in (0, 1):
        r = view.rank(i)
        if r is not None and r != 2:
            return f"input {i} has rank {r}, Gemm needs 2"
    beta = view.attrs.get("beta", 1.0)
    if view.has(2) and beta not in (0.0, 1.0):
        ks = [s[k] for s, k in ((view.shape(0), 0 if view.attrs.get("transA", 0) else 1),
                                (view.shape(1), 1 if view.attrs.get("transB", 0) else 0)) if s and len(s) == 2]
        if not any(isinstance(k, int) and k > 0 for k in ks):
            return (f"beta={beta} where K may be 0 (ORT's CPU kernel then returns C unscaled, the spec beta * C): "
                    f"K is not known to be positive")
    return None


@register("Gemm", 7, dtypes=FLOATS, check=_gemm_check)
def gemm(A, B, C=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, ctx):
    """Y = alpha * A' @ B' + beta * C (C broadcast to the output, optional from opset 11).

    Half types are computed in float32 and rounded once, as ORT's CPU EP does (it upcasts them). On MLX's
    CPU backend C is the product's addend (``mx.addmm``: the BLAS's C, as ORT's own Gemm takes it): a
    broadcast C added after the product is fused by ``mx.compile`` with what follows into a kernel that
    reads it element by element (an MLP of 4 Gemm + Relu layers 1024 wide, batch 64: ~0.3 ms a layer).
    Not in a shapeless trace: replayed at another batch size, ``maximum(addmm(C, A, B), 0)`` gives wrong rows
    past the traced ones (MLX 0.32.4; addmm alone replays right; a closure's verification caught it).
    """
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(f"Gemm needs 2-D A and B, got shapes {A.shape} and {B.shape}")
    half = A.dtype in (mx.float16, mx.bfloat16)
    a = A.astype(mx.float32) if half else A
    b = B.astype(mx.float32) if half else B
    a = a.T if transA else a
    b = b.T if transB else b
    if C is not None and beta != 0.0 and ctx.device == "cpu" and not build.shapeless():
        return mx.addmm(C.astype(a.dtype), a, b, alpha=alpha, beta=beta).astype(A.dtype)
    y = mx.matmul(a, b)
    if alpha != 1.0:
        y = y * mx.array(alpha, dtype=mx.float32).astype(y.dtype)
    if C is not None and beta != 0.0:
        c = C.astype(y.dtype)
        y = y + (c if beta == 1.0 else c * mx.array(beta, dtype=mx.float32).astype(y.dtype))
    return y.astype(A.dtype)


def _einsum_check(view):
    for i in range(view.n_inputs):
        t = view.dtype(i)
        if t is not None and t not in FLOATS:
            return f"input {i} is {dt.name(t)}: only float Einsum is run on MLX"
    eq = view.attrs.get("equation", "")
    if isinstance(eq, bytes):
        eq = eq.decode()
    if not eq.replace(" ", ""):
        return "empty equation"
    return None


@register("Einsum", 12, dtypes=FLOATS, check=_einsum_check)
def einsum(*Inputs, equation):
    """Einstein summation (numpy's implicit-output rule when there is no '->')."""
    if isinstance(equation, bytes):
        equation = equation.decode()
    dtype = Inputs[0].dtype
    if dtype in (mx.float16, mx.bfloat16):          # float32 math, one rounding (ORT upcasts half Einsum)
        Inputs = [x.astype(mx.float32) for x in Inputs]
    return mx.einsum(equation.replace(" ", ""), *Inputs).astype(dtype)

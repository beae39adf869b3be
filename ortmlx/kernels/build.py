"""The context of one graph build: what translators may ask about the build they run in.

A build is an eager run of a group's program or a compiled closure's trace. Its maker creates one
``BuildContext`` and makes it current for the build (``active``); ``Program.build`` takes it as an argument
(a trace passes its own down), and translators and their helpers read it with ``current()``:

- ``cuda_kernels``: whether the custom CUDA kernels may be used (``cuda_kernels.enabled``);
- ``fused_attention``: whether a half-precision prompt's attention may run as MLX's fused kernel, from prompts whose
  power-of-two bucket is ``fused_attention_min`` or more;
- ``prompt_kernel``: whether a prompt's attention not given to MLX's fused kernel may take ours
  (``cuda_kernels.prompt_attention``, with ``cuda_kernels``);
- ``take_rows``: whether a Gather may take ``cuda_kernels.take_rows`` (with ``cuda_kernels``);
- ``row_products``: whether a MatMul of decode rows by a column-major weight takes ``cuda_rows.gemv`` (with
  ``cuda_kernels``), so a decode step is our kernels only and may be replayed (``kernels/cuda_replay.py``);
- ``prompt_rope``: whether a first prompt's packed QKV may become its queries and presents in one kernel
  (``cuda_kernels.prompt_rope``, with ``cuda_kernels``);
- ``unpooled``: whether the lengths every layer's attention reads go into arrays out of MLX's pool of small arrays
  (``consts.unpooled``);
- ``half_nbits``: whether a half-precision MatMulNBits product stays in half precision (else float32);
- ``poly_exp``: whether float32 Exp and Sigmoid use ``fastmath``'s polynomial exp (MLX's CPU backend);
- ``conv_gemm``: which forms of 2-D convolution run as products over their shifted input views (``ops/conv.py``),
  from a batch of ``conv_gemm_batch``;
- ``build_behind``: whether an eager build answers without a fused kernel not built yet, which is built on a
  background thread meanwhile (``kernels/background.py``);
- ``row_limit``: the most rows ``cuda_rows``' product kernels take (1: a lone decode row);
- ``shapeless``/``tracing``: inside a (shapeless) ``mx.compile`` trace: a shapeless trace replays its graph for
  other shapes, so a translator choosing between equivalent forms picks one MLX replays right at any shape
  (static slices, ``split`` and ``mx.fast.rope`` fail there);
- ``memo``: work several nodes repeat on the same values (every attention layer's rotary rows and mask);
- ``guards``/``hints`` (traces only): checks that must hold for the traced answer to be used, and the rows a
  decode trace writes into its in-place outputs (``compiled/decode_ops.py``).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field


@dataclass
class BuildContext:
    cuda_kernels: bool = False
    fused_attention: bool = False
    fused_attention_min: int = 1
    prompt_kernel: bool = True
    take_rows: bool = False
    row_products: bool = False
    prompt_rope: bool = False
    unpooled: bool = False
    half_nbits: bool = False
    poly_exp: bool = False
    conv_gemm: frozenset = frozenset()
    conv_gemm_batch: int = 1
    build_behind: bool = False
    row_limit: int = 1
    shapeless: bool = False
    tracing: bool = False
    memo: dict = field(default_factory=dict)
    #: traced guards (None outside a trace: a guarded traced form there is an error)
    guards: list | None = None
    #: row hints declared by the trace: (present, past, start, rows)
    hints: list | None = None


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("ortmlx_build", default=None)


def current() -> BuildContext | None:
    """The build in progress on this thread (None outside one)."""
    return _CURRENT.get()


@contextlib.contextmanager
def active(ctx: BuildContext):
    """Make ``ctx`` the current build for the block (the outer one is current again after it)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def shapeless() -> bool:
    """Whether this thread is building a shapeless trace (False in eager builds and shape-keyed traces)."""
    b = _CURRENT.get()
    return b is not None and b.shapeless


def fused_attention(length: int) -> bool:
    """Whether the build in progress may run the attention of a ``length``-token prompt as MLX's fused kernel: from
    ``fused_attention_min`` (a power of two), compared with the length rounded up to a power of two, so that a
    prompt and the padded bucket that serves it (``compiled/attention.bucket_for``) take the same form and a
    bucket's closure is verified against eager arithmetic of its own kind."""
    b = _CURRENT.get()
    return b is not None and b.fused_attention and 1 << max(length - 1, 0).bit_length() >= b.fused_attention_min


def prompt_kernel() -> bool:
    """Whether the build in progress may run a prompt's attention as ``cuda_kernels.prompt_attention``."""
    b = _CURRENT.get()
    return b is not None and b.prompt_kernel


def take_rows() -> bool:
    """Whether the build in progress may gather with ``cuda_kernels.take_rows``."""
    b = _CURRENT.get()
    return b is not None and b.take_rows


def row_products() -> bool:
    """Whether the build in progress may multiply decode rows with ``cuda_rows.gemv``."""
    b = _CURRENT.get()
    return b is not None and b.row_products


def prompt_rope() -> bool:
    """Whether the build in progress may make a first prompt's queries and presents in one kernel."""
    b = _CURRENT.get()
    return b is not None and b.prompt_rope


def unpooled() -> bool:
    """Whether the build in progress keeps small lengths out of MLX's pool (``consts.unpooled``)."""
    b = _CURRENT.get()
    return b is not None and b.unpooled


def half_nbits() -> bool:
    """Whether the build in progress keeps a half-precision MatMulNBits product in half precision."""
    b = _CURRENT.get()
    return b is not None and b.half_nbits


def poly_exp() -> bool:
    """Whether the build in progress computes float32 exponentials with ``fastmath``'s polynomial."""
    b = _CURRENT.get()
    return b is not None and b.poly_exp


def conv_gemm(batch: int) -> frozenset:
    """The forms of 2-D convolution the build in progress runs as products over shifted views at this batch
    (``BuildContext.conv_gemm``: a subset of ``ops/conv.py``'s ``GEMM_FORMS``)."""
    b = _CURRENT.get()
    return b.conv_gemm if b is not None and batch >= b.conv_gemm_batch else frozenset()


def build_behind() -> bool:
    """Whether the build in progress answers without fused kernels not built yet (``BuildContext.build_behind``)."""
    b = _CURRENT.get()
    return b is not None and b.build_behind


def row_limit() -> int:
    """The most rows the row kernels take in the build in progress (``BuildContext.row_limit``; 1 outside one)."""
    b = _CURRENT.get()
    return 1 if b is None else b.row_limit


def tracing() -> bool:
    """Whether this thread is inside a compiled closure's trace."""
    b = _CURRENT.get()
    return b is not None and b.tracing


def memo(key: tuple, make):
    """``make()`` once per build for ``key`` (outside a build: every time).

    Eager builds have no common-subexpression pass. Object ids in ``key`` must be of values the build keeps
    alive to its end (group inputs, constants, the build's device copies), so an id is not reused within it."""
    b = _CURRENT.get()
    if b is None:
        return make()
    got = b.memo.get(key)
    if got is None:
        got = b.memo[key] = make()
    return got

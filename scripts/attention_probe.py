"""What a prompt's attention costs at a new length: the first call and the next two, per form.

    python scripts/attention_probe.py sdpa_mask,sdpa_causal,ops,ep_ops 38,64,151,256,486,2048

Qwen2.5-0.5B's shape (14 query heads, 2 KV heads of 64, float16), one process, lengths in the order given:

- ``sdpa_mask``: MLX's fused kernel (``mx.fast.scaled_dot_product_attention``; cuDNN's on CUDA) with a boolean
  causal mask array, as the EP called it before 651f6a0;
- ``sdpa_causal``: the same with ``mask="causal"`` (the EP's fused form where no kept row lies past its length);
- ``ops``: float16 products, the softmax in float32 (a cheap unfused form);
- ``ep_ops``: the EP's own unfused form (``contrib_attention.prompt_attention``: q, k, v widened to float32).

On MLX 0.32.4's CUDA backend the first call of a fused form at a new length includes cuDNN's graph build (and,
on a host whose driver cache has not seen it, the build of its kernels); the unfused forms build nothing new
per length. Run it first in a process to see a fresh process's cost, and on a fresh host for a fresh host's.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ortmlx  # noqa: E402,F401  (before MLX: its environment)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from ortmlx.kernels import build  # noqa: E402
from ortmlx.kernels.ops import contrib_attention as ca  # noqa: E402

HEADS, KV_HEADS, HEAD = 14, 2, 64
FORMS = ("sdpa_mask", "sdpa_causal", "ops", "ep_ops")


def attention(form: str, s: int):
    """A function of no arguments computing one ``form`` of a first prompt's attention over ``s`` tokens."""
    q = mx.random.normal((1, HEADS, s, HEAD)).astype(mx.float16)
    k = mx.random.normal((1, KV_HEADS, s, HEAD)).astype(mx.float16)
    v = mx.random.normal((1, KV_HEADS, s, HEAD)).astype(mx.float16)
    pos = mx.arange(s)
    mask = (pos[None, :] <= pos[:, None]).reshape(1, 1, s, s)
    total = mx.array([s], mx.int32)
    mx.eval(q, k, v, mask, total)
    scale, group = HEAD ** -0.5, HEADS // KV_HEADS
    if form == "sdpa_mask":
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    if form == "sdpa_causal":
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    if form == "ops":
        def ops():
            sc = (q.reshape(1, KV_HEADS, group * s, HEAD) @ k.swapaxes(-1, -2)).reshape(1, HEADS, s, s)
            p = mx.softmax(mx.where(mask, sc.astype(mx.float32) * scale, -np.inf), axis=-1).astype(mx.float16)
            return (p.reshape(1, KV_HEADS, group * s, s) @ v).reshape(1, HEADS, s, HEAD)
        return ops

    def ep_ops():
        with build.active(build.BuildContext(fused_attention=False)):
            return ca.prompt_attention(q, k, v, q.astype(mx.float32), total - 1, mx.zeros((1,), mx.int32), total,
                                       alpha=scale, softcap=0.0, local_window_size=-1, sink=None,
                                       attention_bias=None, causal=True)
    return ep_ops


def timed(fn) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return 1e3 * (time.perf_counter() - t)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or any(f not in FORMS for f in argv[0].split(",")):
        print(__doc__)
        return 2
    print(f"MLX {mx.__version__} on {mx.default_device()}; ms a call")
    for form in argv[0].split(","):
        for s in (int(x) for x in argv[1].split(",")):
            fn = attention(form, s)
            first, second, third = timed(fn), timed(fn), timed(fn)
            print(f"{form:12s} S={s:5d} first {first:8.1f}  second {second:7.2f}  third {third:7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

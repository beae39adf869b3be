"""What a kernel pays for reading a tiny MLX array on MLX's CUDA backend.

    python scripts/small_array_probe.py

MLX allocates arrays of 8 bytes or less from a pool in managed memory mapped into the GPU, larger ones in device
memory. A custom kernel reading element 0 of a 4-, 8- or 16-byte int32 array (and adding it to a 28,672-float
array), 200 launches chained in one evaluation, median of 7: the time a launch, with the small array made once,
and made from the host before every evaluation (as a call's input is). Then MLX's own ``maximum`` of a
[1, 32, 256, 256] float32 array and a scalar (a ReLU), 50 chained: the scalar a 0-d array (MLX's pool) against
element 0 of a 4-element array (device memory).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOURCE = """
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    int n = lenp[0];
    if (i < x_shape[0]) out[i] = x[i] + static_cast<float>(n);
"""


def main() -> int:
    import mlx.core as mx
    import numpy as np
    import ortmlx  # noqa: F401 - the environment ortmlx sets for MLX
    from ortmlx.kernels import cuda_kernels
    if not cuda_kernels.cuda_backend():
        print("small_array_probe: needs MLX's CUDA backend")
        return 1
    k = mx.fast.cuda_kernel(name="small_array_probe", input_names=["x", "lenp"], output_names=["out"], source=SOURCE)
    x = mx.zeros((14 * 64 * 32,))
    mx.eval(x)

    def chain(lenp, n=200):
        y = x
        for _ in range(n):
            (y,) = k(inputs=[y, lenp], grid=(y.size, 1, 1), threadgroup=(256, 1, 1), output_shapes=[y.shape],
                     output_dtypes=[mx.float32])
        return y
    for fresh in (False, True):
        for size in (1, 2, 4):
            base = mx.array(np.arange(size, dtype=np.int32))
            mx.eval(base)
            mx.eval(chain(base))
            ts = []
            for _ in range(7):
                lenp = mx.array(np.arange(size, dtype=np.int32)) if fresh else base
                t = time.perf_counter()
                mx.eval(chain(lenp))
                ts.append(time.perf_counter() - t)
            how = "new from the host each call" if fresh else "made once"
            print(f"lenp {size * 4} bytes, {how}: {np.median(ts) / 200 * 1e6:.2f} us a kernel (200 chained)",
                  flush=True)
    big = mx.random.normal((1, 32, 256, 256))
    mx.eval(big)
    for label, zero in (("a 0-d array", lambda: mx.array(0.0)), ("element 0 of 4", lambda: mx.zeros((4,))[0])):
        z = zero()
        mx.eval(z)
        ts = []
        for _ in range(7):
            y = big
            for _ in range(50):
                y = mx.maximum(y, z)
            t = time.perf_counter()
            mx.eval(y)
            ts.append(time.perf_counter() - t)
        print(f"maximum with a scalar, {label}: {np.median(ts) / 50 * 1e6:.2f} us an op (50 chained)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What host<->device traffic costs MLX on this machine: small uploads, a kernel, and host reads of
fresh device results (medians of 200). On a GPU, MLX's memory is read through page migration.

    python scripts/gpu_io_probe.py          # run where MLX's default device is the GPU
"""
import time

import mlx.core as mx
import numpy as np


def t(f, n=200):
    f(); ts = []
    for _ in range(n):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return 1e6 * sorted(ts)[n // 2]
small = np.array([[5]], np.int32)
def up1(): mx.eval(mx.array(small))
def up3(): mx.eval(mx.array(small), mx.array(np.array([6], np.int32)), mx.array(np.array(7, np.int32)))
x24 = mx.zeros((24 * 1024,), mx.uint8) + 1; x300 = mx.zeros((300 * 1024,), mx.uint8) + 1; mx.eval(x24, x300)
def dn(a):
    def f():
        b = a + 0; mx.eval(b); np.array(b, copy=True)   # fresh device result each time, then read on host
    return f
def kern():
    b = x24 + 0; mx.eval(b)
print("device", mx.default_device())
print("upload 1 small array + eval: %.1f us" % t(up1))
print("upload 3 small arrays + eval: %.1f us" % t(up3))
print("one tiny kernel + eval: %.1f us" % t(kern))
print("kernel + eval + host read 24 KB: %.1f us" % t(dn(x24)))
print("kernel + eval + host read 300 KB: %.1f us" % t(dn(x300)))
x324 = mx.zeros((324 * 1024,), mx.uint8) + 1; mx.eval(x324)
print("kernel + eval + host read 324 KB: %.1f us" % t(dn(x324)))
def two():
    b = x24 + 0; c = x300 + 0; mx.eval(b, c); np.array(b, copy=True); np.array(c, copy=True)
print("two kernels + eval + reads 24 KB and 300 KB: %.1f us" % t(two))

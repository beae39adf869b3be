"""runtime/upload.py: host arrays onto the device through page-locked staging (the CUDA parts run on a GPU)."""
import ctypes

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels import cuda_kernels
from ortmlx.kernels import dtypes as dt
from ortmlx.runtime import upload as U

GPU = cuda_kernels.usable() and U.uploader("gpu") is not dt.to_mx


class _Buffer:
    """A stand-in for HostBuffer: host memory whose 'device address' is its host address."""

    def __init__(self, drv, nbytes):
        self.nbytes = nbytes
        self.array = np.zeros(nbytes, np.uint8)
        self.host_address = self.device_address = self.array.ctypes.data

    def free(self):
        self.array = None


def _reads(log):
    def copier(source, n):
        addr, count = (int(v) for v in np.array(source))
        assert count == n
        log.append(n)
        return mx.array(np.frombuffer(ctypes.string_at(addr, n), np.uint8).copy())
    return copier


@pytest.mark.parametrize("t,shape", [(dt.FLOAT, (512, 1024)), (dt.FLOAT16, (3, 700, 513)), (dt.INT64, (131073,)),
                                     (dt.INT8, (1 << 20,))])
def test_staged_copies_are_the_array(t, shape):
    log = []
    u = U.Uploader(None, copier=_reads(log), buffer=_Buffer)
    a = (np.arange(int(np.prod(shape))) % 251 - 100).astype(dt.NUMPY[t]).reshape(shape)
    got = u(a, t)
    assert log and got.dtype == dt.MLX[t] and got.shape == shape
    np.testing.assert_array_equal(np.array(got), a)
    assert u.uploads == 1


def test_large_arrays_go_through_both_buffers_in_turn():
    log = []
    u = U.Uploader(None, copier=_reads(log), buffer=_Buffer)
    a = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    got = u.staged(a, mx.float32, chunk=4096)          # 40,000 bytes: 9 whole chunks and a short one
    assert log == [4096] * 9 + [40_000 - 9 * 4096] and len(u._stage) == 2
    np.testing.assert_array_equal(np.array(got), a)


def test_small_odd_or_failing_inputs_take_mlx_copy():
    log = []
    u = U.Uploader(None, copier=_reads(log), buffer=_Buffer)
    small = np.ones(1000, np.float32)
    np.testing.assert_array_equal(np.array(u(small, dt.FLOAT)), small)
    big = np.ones((2048, 1024), np.float32)
    np.testing.assert_array_equal(np.array(u(big[:, ::2], dt.FLOAT)), big[:, ::2])     # not row-major
    np.testing.assert_array_equal(np.array(u(np.ones(1 << 21, bool), dt.BOOL)), np.ones(1 << 21, bool))
    assert not log and u.uploads == 0

    def broken(source, n):
        raise RuntimeError("no kernel")
    b = U.Uploader(None, copier=broken, buffer=_Buffer)
    for _ in range(4):
        np.testing.assert_array_equal(np.array(b(big, dt.FLOAT)), big)
    assert b.failed == 3                                 # then never tried again


def test_off_the_gpu_it_is_mlx_copy():
    assert U.uploader("cpu") is dt.to_mx
    assert U.uploader("gpu", enabled=False) is dt.to_mx


@pytest.mark.skipif(not GPU, reason="needs MLX's CUDA backend and the custom kernels")
@pytest.mark.parametrize("n", [1 << 20, (1 << 20) + 12, 3 * U.STAGE_BYTES + 4096])
def test_on_the_gpu(n):
    u = U.uploader("gpu")
    a = (np.arange(n // 2) % 30011).astype(np.float16)
    before = u.uploads
    got = u(a, dt.FLOAT16)
    assert u.uploads == before + 1
    np.testing.assert_array_equal(np.array(got + 0), a)


@pytest.mark.skipif(not GPU, reason="needs MLX's CUDA backend and the custom kernels")
def test_a_session_stages_its_large_inputs():
    from onnx import TensorProto as T
    from onnx import helper

    from ortmlx.testing import check_against_cpu, make_model
    node = helper.make_node("Mul", ["x", "x"], ["y"])
    model = make_model([node], [("x", T.FLOAT, [1024, 1024])], [("y", T.FLOAT, None)], {})
    u = U.uploader("gpu")
    before = u.uploads
    feeds = [{"x": np.random.default_rng(i).standard_normal((1024, 1024)).astype(np.float32)} for i in range(3)]
    check_against_cpu(model, feeds)
    assert u.uploads >= before + 3

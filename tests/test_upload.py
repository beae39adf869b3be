"""runtime/upload.py: host arrays onto the device through page-locked staging (the CUDA parts run on a GPU)."""
import ctypes

import mlx.core as mx
import numpy as np
import pytest

from ortmlx.kernels import consts, cuda_kernels
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
    """The copy kernel's contract: an ``n``-byte output holding the header's count of bytes (at most ``n``); never
    an output MLX would put in its pool of 8 bytes or less."""
    def copier(stage, n):
        assert stage.dtype == mx.uint64 and stage.size == 1 and n >= consts.ROOM_BYTES
        addr = int(np.array(stage).reshape(-1)[0])
        count = ctypes.c_uint64.from_address(addr).value                # the header's count
        assert count <= n
        log.append(count)
        out = np.full(n, 0xEE, np.uint8)                                # bytes past the count: not written
        out[:count] = np.frombuffer(ctypes.string_at(addr + U._HEADER, count), np.uint8)
        return mx.array(out)
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


def test_small_arrays_each_take_a_buffer_of_the_ring():
    log = []
    u = U.Uploader(None, copier=_reads(log), buffer=_Buffer)
    arrs = [np.arange(k + 2, dtype=np.int64) * 3 - k for k in range(U.SMALL_SLOTS + 3)]
    got = [u(a, dt.INT64) for a in arrs]             # more than the ring: the first buffers are written again
    assert log == [a.nbytes for a in arrs] and u.small_uploads == len(arrs) and u.uploads == 0
    for a, g in zip(arrs, got):
        np.testing.assert_array_equal(np.array(g), a)
    n, log[:] = u.small_uploads, []
    scalar = u(np.array(2.5, np.float32), dt.FLOAT)             # 8 bytes or less: MLX's copy
    assert scalar.shape == () and float(scalar) == 2.5 and u.small_uploads == n
    pair = u(np.array([7, -1], np.int32), dt.INT32)
    assert pair.tolist() == [7, -1] and u.small_uploads == n
    three = u(np.array([[7, -1, 9]], np.int32), dt.INT32)      # 12 bytes: a view into the copy's 16
    assert three.shape == (1, 3) and three.tolist() == [[7, -1, 9]]
    assert u.small_uploads == n + 1 and log == [12] and u.failed == 0


class _Lazy:
    """A copy that reads its buffer only when evaluated, as the kernel does."""

    def __init__(self, addr, n):
        self.addr, self.n, self.bytes = addr, n, None

    def run(self):
        if self.bytes is None:          # the count from the header, bounded by the output's size (the kernel's rule)
            self.bytes = ctypes.string_at(self.addr + U._HEADER, min(ctypes.c_uint64.from_address(self.addr).value,
                                                                     self.n))

    def view(self, m):
        return self

    def reshape(self, shape):
        return self


class _MX:
    """mlx.core, with ``eval`` running ``_Lazy`` copies."""

    def __getattr__(self, k):
        return getattr(mx, k)

    @staticmethod
    def eval(*xs):
        for x in xs:
            x.run() if isinstance(x, _Lazy) else mx.eval(x)


def _lazy_copier(copies):
    def copier(stage, n):
        copies.append(_Lazy(int(np.array(stage).reshape(-1)[0]), n))
        return copies[-1]
    return copier


def test_a_buffer_is_written_again_only_after_its_last_copy_has_run(monkeypatch):
    monkeypatch.setattr(U, "mx", _MX())
    copies = []
    u = U.Uploader(None, copier=_lazy_copier(copies), buffer=_Buffer)
    arrs = [np.full(4 + k % 3, k, np.int32) for k in range(2 * U.SMALL_SLOTS + 1)]   # 16-24 bytes: counts differ
    for a in arrs:                       # nothing evaluated: the ring's wrap-around must run the old copies
        u(a, dt.INT32)
    assert [c.bytes is not None for c in copies] == [True] * (U.SMALL_SLOTS + 1) + [False] * U.SMALL_SLOTS
    for c, a in zip(copies, arrs):
        c.run()
        assert c.bytes == a.tobytes()


def test_each_thread_has_a_ring_of_its_own(monkeypatch):
    """Only the thread that made a copy can tell that it has run (MLX keeps a thread's streams to itself): another
    thread's uploads never wait for, run or overwrite it."""
    import threading
    monkeypatch.setattr(U, "mx", _MX())
    copies = []
    u = U.Uploader(None, copier=_lazy_copier(copies), buffer=_Buffer)
    mine = [np.full(5, k, np.int32) for k in range(U.SMALL_SLOTS)]
    for a in mine:                                  # this thread's ring full of copies not yet run
        u(a, dt.INT32)
    theirs = [np.full(6, -k, np.int32) for k in range(U.SMALL_SLOTS + 2)]
    t = threading.Thread(target=lambda: [u(a, dt.INT32) for a in theirs])
    t.start()
    t.join()
    assert [c.bytes is None for c in copies[:U.SMALL_SLOTS]] == [True] * U.SMALL_SLOTS
    assert u.failed == 0 and u.small_uploads == len(mine) + len(theirs)
    for c, a in zip(copies, mine):
        c.run()
        assert c.bytes == a.tobytes()


def test_small_odd_or_failing_inputs_take_mlx_copy():
    log = []
    u = U.Uploader(None, copier=_reads(log), buffer=_Buffer)
    big = np.ones((2048, 1024), np.float32)
    np.testing.assert_array_equal(np.array(u(big[:, ::2], dt.FLOAT)), big[:, ::2])     # not row-major
    np.testing.assert_array_equal(np.array(u(np.ones(1 << 21, bool), dt.BOOL)), np.ones(1 << 21, bool))
    np.testing.assert_array_equal(np.array(u(np.ones(0, np.float32), dt.FLOAT)), np.ones(0, np.float32))
    assert not log and u.uploads == 0 and u.small_uploads == 0

    def broken(stage, n):
        raise RuntimeError("no kernel")
    b = U.Uploader(None, copier=broken, buffer=_Buffer)
    for _ in range(4):
        np.testing.assert_array_equal(np.array(b(big, dt.FLOAT)), big)
    assert b.failed == 3                                 # then never tried again


def test_inside_a_trace_small_arrays_take_mlx_copy():
    """A trace would replay the copy kernel from a buffer since reused: small uploads there are MLX's copies."""
    from ortmlx.kernels import build
    log = []
    u = U.Uploader(None, copier=_reads(log), buffer=_Buffer)
    a = np.arange(6, dtype=np.float32)
    with build.active(build.BuildContext(tracing=True)):
        got = u(a, dt.FLOAT)
    assert not log and u.small_uploads == 0
    np.testing.assert_array_equal(np.array(got), a)


def test_off_the_gpu_it_is_mlx_copy():
    assert U.uploader("cpu") is dt.to_mx
    assert U.uploader("gpu", enabled=False) is dt.to_mx


@pytest.mark.skipif(not GPU, reason="needs MLX's CUDA backend and the custom kernels")
@pytest.mark.parametrize("n", [12, 4100, (1 << 20) - 2, 1 << 20, (1 << 20) + 12, 3 * U.STAGE_BYTES + 4096])
def test_on_the_gpu(n):
    u = U.uploader("gpu")
    a = (np.arange(n // 2) % 30011).astype(np.float16)
    before = u.uploads + u.small_uploads
    got = u(a, dt.FLOAT16)
    assert u.uploads + u.small_uploads == before + 1
    np.testing.assert_array_equal(np.array(got + 0), a)


@pytest.mark.skipif(not GPU, reason="needs MLX's CUDA backend and the custom kernels")
def test_on_the_gpu_lazy_small_copies_around_the_ring():
    u = U.uploader("gpu")
    arrs = [np.arange(k, k + 5, dtype=np.int64) for k in range(3 * U.SMALL_SLOTS)]
    got = [u(a, dt.INT64) for a in arrs]              # none evaluated until the ring wraps
    for a, g in zip(arrs, got):
        np.testing.assert_array_equal(np.array(g * 1), a)


@pytest.mark.skipif(not GPU, reason="needs MLX's CUDA backend and the custom kernels")
def test_on_the_gpu_a_wrong_count_cannot_write_past_the_copy():
    """The kernel copies at most its output's size, whatever the header says (a count of 2^40 unbounded would read
    far past the buffer: an illegal address)."""
    from ortmlx.kernels.cuda_driver import driver
    st = U.Stage(driver(), 4096, U.HostBuffer)
    data = (np.arange(4096) % 253).astype(np.uint8)
    ctypes.memmove(st.buf.host_address + U._HEADER, data.ctypes.data, data.size)
    for count, n in ((1 << 40, 4000), (4096, 40), (4096, 1000)):
        ctypes.c_uint64.from_address(st.buf.host_address).value = count
        np.testing.assert_array_equal(np.array(cuda_kernels.copy_from_address(st.address, n)), data[:n])
    ctypes.c_uint64.from_address(st.buf.host_address).value = 24            # fewer: those bytes are copied
    np.testing.assert_array_equal(np.array(cuda_kernels.copy_from_address(st.address, 64))[:24], data[:24])
    st.free()


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


@pytest.mark.skipif(not GPU, reason="needs MLX's CUDA backend and the custom kernels")
def test_a_session_stages_its_small_inputs():
    from onnx import TensorProto as T
    from onnx import helper

    from ortmlx.testing import check_against_cpu, make_model
    nodes = [helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("Mul", ["s", "x"], ["z"])]
    model = make_model(nodes, [("x", T.FLOAT, [1, 4]), ("y", T.FLOAT, [1, 4])], [("z", T.FLOAT, None)], {})
    u = U.uploader("gpu")
    before = u.small_uploads
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 4)).astype(np.float32), "y": rng.standard_normal((1, 4)).astype(np.float32)}
             for _ in range(3 * U.SMALL_SLOTS)]
    check_against_cpu(model, feeds)
    assert u.small_uploads >= before + len(feeds)



#: a new process's first call: an Einsum summing a (0, 3) input to a scalar
_FIRST_EMPTY_SUM = r"""
import numpy as np
from onnx import helper, TensorProto as T
from ortmlx.testing import session
g = helper.make_graph([helper.make_node("Einsum", ["x"], ["y"], equation="ab->")], "g",
                      [helper.make_tensor_value_info("x", T.FLOAT, [0, 3])],
                      [helper.make_tensor_value_info("y", T.FLOAT, None)])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 12)], ir_version=8)
print(float(session(m).run(None, {"x": np.ones((0, 3), np.float32)})[0]))
"""


def test_an_empty_host_array_uploads_as_a_fresh_empty():
    """MLX 0.32.4's CPU sum over an empty array copied from NumPy leaves its result unwritten: a new process's
    first Einsum ``ab->`` over a (0, 3) input answered the allocator's leftovers (5 of 5 processes, 1e-19 to
    -3e37). An empty upload is a fresh empty array (as the interpreter's empty step outputs), whose sum is 0."""
    import subprocess
    import sys

    from ortmlx.testing import child_env
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", _FIRST_EMPTY_SUM], capture_output=True, text=True, timeout=120,
                           env=child_env())
        assert r.returncode == 0, r.stderr[-2000:]
        assert float(r.stdout.split()[-1]) == 0.0
    for shape, t, want in (((0, 3), dt.FLOAT, mx.float32), ((2, 0), dt.FLOAT16, mx.float16),
                           ((0,), dt.INT64, mx.int64)):
        x = dt.to_mx(np.ones(shape, dt.NUMPY[t]), t)
        assert x.shape == shape and x.dtype == want

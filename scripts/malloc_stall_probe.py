"""Why the first host work after an MLX eval runs slow: glibc's fastbin consolidation.

    python scripts/malloc_stall_probe.py plain|nofast|settle

Builds an 800-op lazy MLX graph, evaluates it, drops it, then times the first and the second 3 KB
allocation (``bytearray``), 50 rounds, medians in us. ``plain``: as MLX leaves the heap (the graph's many
small C++ objects were freed into glibc's fastbins; the first request of 1 KB or more consolidates them
all). ``nofast``: ``mallopt(M_MXFAST, 0)`` (no fastbins). ``settle``: ``mx.async_eval``, one 4 KB
allocation while the work runs, then ``mx.eval`` (the consolidation happens during the eval's wait).
"""
import sys, time, statistics, ctypes
import mlx.core as mx
if "nofast" in sys.argv:     # M_MXFAST = 1
    ctypes.CDLL("libc.so.6").mallopt(1, 0)
x = mx.ones((64,)); mx.eval(x)
T = {"first": [], "second": []}
for rep in range(60):
    y = x
    for i in range(800):
        y = y * 1.0001 + 0.5
    if "settle" in sys.argv:
        mx.async_eval(y); b = bytearray(4096); del b
    mx.eval(y)
    del y
    t0 = time.perf_counter_ns(); a = bytearray(3076); t1 = time.perf_counter_ns(); c = bytearray(3076); t2 = time.perf_counter_ns()
    if rep >= 10:
        T["first"].append(t1 - t0); T["second"].append(t2 - t1)
print(sys.argv[1:], {k: round(statistics.median(v) / 1e3, 1) for k, v in T.items()})

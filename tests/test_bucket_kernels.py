"""A new prefill bucket builds no new MLX kernels: nothing a bucket's trace fuses holds the bucket's length as a
constant (MLX writes size-1 constants into a fused kernel's source, so such a kernel is built again, with g++ or
NVRTC, for every bucket: seconds of a first call at a new prompt length)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from ortmlx.kernels import consts
from ortmlx.kernels.ops.contrib_attention import _present

from test_compiled_genai import model_dir

CHILD = r"""
import glob, json, os, sys
import numpy as np
import onnxruntime_genai as og
from ortmlx import genai as mg
from ortmlx.version import mlx_cache_dir
model, _ = mg.load_model(sys.argv[1], "mlx", {"device": "cpu"})
def files():
    return len(glob.glob(os.path.join(mlx_cache_dir(), "**", "*"), recursive=True))
counts = []
for n in (10, 12, 20, 22):                  # buckets 16, 16, 32, 32: each bucket's closure verifies at two lengths
    gen = og.Generator(model, mg.search_options(model, 96))
    gen.append_tokens(np.arange(5, 5 + n, dtype=np.int32))
    gen.generate_next_token()
    del gen
    counts.append(files())
del model
print(json.dumps(counts))
"""


@pytest.mark.slow   # a fresh kernel cache: every kernel of the tiny model built with g++ (~20 s on 2 cores)
def test_a_new_bucket_builds_no_kernels():
    path = model_dir("llama")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TMPDIR": tmp}
        env.pop("MLX_PTX_CACHE_DIR", None)
        r = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        counts = json.loads(r.stdout.strip().splitlines()[-1])
    assert counts[0] > 0, counts                    # the first bucket built the model's kernels
    assert counts[3] == counts[1], counts           # bucket 32 built none of its own


def test_first_prompt_present_is_new_rows_then_zeros():
    """``_present(first=True)`` (no fused kernel with S in it) equals the general gather form at past_len 0."""
    rng = np.random.default_rng(5)
    import mlx.core as mx
    past = mx.array(rng.standard_normal((2, 3, 20, 8)).astype(np.float32))
    zero = consts.zeros((2,), mx.int32)
    for s in (1, 7):                            # a one-token prompt too
        new = mx.array(rng.standard_normal((2, 3, s, 8)).astype(np.float32))
        for p in (None, past):
            want = np.asarray(_present(p, new, zero, 20))
            got = np.asarray(_present(p, new, zero, 20, first=True))
            assert np.array_equal(got, want)
            assert np.array_equal(got[:, :, :s], np.asarray(new)) and not got[:, :, s:].any()

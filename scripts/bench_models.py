"""Build the benchmark LLMs for an accelerator: models/build_llm.py's random-weight HF
checkpoint, then onnxruntime-genai's builder targeting ``-e cuda`` (GroupQueryAttention with
a shared KV buffer, ~1/4 of the nodes of the ``-e cpu`` fp16 graph, whose attention is
MultiHeadAttention plus repeat_kv shape math). The MLX EP runs either; genai's provider list is
replaced at load time (ortmlx.genai.make_config).

    python scripts/bench_models.py --size 0.5b [--size 1.5b] [--precision fp16] [--precision int4] [--out models/out]
    python scripts/bench_models.py --size 0.5b --prune-lm-head      # the builder's prune_lm_head: -gqa-prune/

Output: <out>/qwen2-<size>-<precision>-gqa/ and the checkpoint <out>/hf/qwen2-<size>/. ``--prune-lm-head`` builds
with the builder's ``prune_lm_head=true`` (the LM head reads the last token only: a prompt's logits are one row
per batch row) into <out>/qwen2-<size>-<precision>-gqa-prune/. Builds are
cached (a marker file with build_llm's recipe: the benchmark sizes' scaled output projections and
8,192-position context: build_llm.BENCH_SIZES, part of the build's fingerprint); ``--force`` rebuilds. The last line printed per
build is ``<dir>: <seconds> s`` (0.0 when cached) for scripts/bench_llm.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "models"))

import torch  # noqa: E402,F401  (before the builder puts its folder on sys.path)
import transformers  # noqa: E402,F401

import build_llm as B  # noqa: E402


def build(size: str, precision: str, arch: str = "qwen2", root: str = B.OUT_ROOT, force: bool = False,
          prune: bool = False) -> str:
    """Build (or reuse) <root>/<arch>-<size>-<precision>-gqa[-prune]; return its directory."""
    out = B.gqa_dir(size, precision, arch, root, prune)
    if not force and B._is_built(out, B.fingerprint(arch, size)):
        return out
    t0 = time.perf_counter()
    hf = B.ensure_hf(arch, size, root, force)
    shutil.rmtree(out, ignore_errors=True)
    tmp = out + ".tmp"
    cache = out + ".cache"
    shutil.rmtree(tmp, ignore_errors=True)
    b = B._genai_builder()
    opts = b.parse_extra_options(None, hf, tmp, precision, "cuda", cache, ["prune_lm_head=true"] if prune else [])
    b.create_model(None, hf, tmp, precision, "cuda", cache, **opts)
    shutil.rmtree(cache, ignore_errors=True)
    with open(os.path.join(tmp, B.MARKER), "w") as f:
        json.dump({"recipe": B.RECIPE, "config": B.fingerprint(arch, size), "arch": arch, "size": size, "precision": precision,
                   "execution_provider": "cuda", "prune_lm_head": prune, "seconds": round(time.perf_counter() - t0, 2)}, f)
    os.replace(tmp, out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", action="append", choices=sorted(B.SIZES), required=True)
    ap.add_argument("--precision", action="append", choices=B.PRECISIONS, help="repeatable (default fp16)")
    ap.add_argument("--arch", default="qwen2", choices=B.ARCHS)
    ap.add_argument("--out", default=B.OUT_ROOT)
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    ap.add_argument("--prune-lm-head", action="store_true", help="the builder's prune_lm_head (last-token logits)")
    args = ap.parse_args(argv)
    for size in args.size:
        for precision in args.precision or ["fp16"]:
            t0 = time.time()
            out = build(size, precision, args.arch, args.out, args.force, args.prune_lm_head)
            print(f"{out}: {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

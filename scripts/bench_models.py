"""Build the benchmark LLMs for an accelerator: models/build_llm.py's random-weight HF
checkpoint, then onnxruntime-genai's builder targeting ``-e cuda`` (GroupQueryAttention with
a shared KV buffer, ~1/4 of the nodes of the ``-e cpu`` fp16 graph, whose attention is
MultiHeadAttention plus repeat_kv shape math). The MLX EP runs either; genai's provider list is
replaced at load time (ortmlx.genai.make_config).

    python scripts/bench_models.py --size 0.5b [--size 1.5b] [--precision fp16] [--out models/out]

Output: <out>/qwen2-<size>-<precision>-gqa/ and the checkpoint <out>/hf/qwen2-<size>/.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "models"))

import torch  # noqa: E402,F401  (before the builder puts its folder on sys.path)
import transformers  # noqa: E402,F401

import build_llm as B  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", action="append", choices=sorted(B.SIZES), required=True)
    ap.add_argument("--precision", default="fp16", choices=B.PRECISIONS)
    ap.add_argument("--arch", default="qwen2", choices=B.ARCHS)
    ap.add_argument("--out", default=B.OUT_ROOT)
    args = ap.parse_args(argv)
    for size in args.size:
        t0 = time.time()
        hf = os.path.join(args.out, "hf", f"{args.arch}-{size}")
        if not os.path.exists(os.path.join(hf, "config.json")):
            B.build_hf(args.arch, size, hf)
        out = os.path.join(args.out, f"{args.arch}-{size}-{args.precision}-gqa")
        if not os.path.exists(os.path.join(out, "genai_config.json")):
            b = B._genai_builder()
            cache = out + ".cache"
            opts = b.parse_extra_options(None, hf, out, args.precision, "cuda", cache, [])
            b.create_model(None, hf, out, args.precision, "cuda", cache, **opts)
        print(f"{out}: {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

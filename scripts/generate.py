"""Stream a greedy generation from an onnxruntime-genai model on the MLX EP.

    python scripts/generate.py models/out/qwen2-tiny-int4 --prompt "Once upon a time" \
        [--max-new-tokens 64] [--provider mlx|cpu] [--option no_compile=1] [--sample] [--report]

Prints the text as it is generated, then tokens/s; --report prints the MLX partition report
(what ran on MLX, what stayed on the CPU EP and why).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ortmlx import genai as mg  # noqa: E402


def parse_option(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--option takes key=value, got {text!r}")
    k, v = text.split("=", 1)
    return k.strip(), v.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="directory with genai_config.json (e.g. models/out/llama-tiny-fp32)")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--provider", choices=mg.PROVIDERS, default="mlx")
    ap.add_argument("--option", type=parse_option, action="append", default=[],
                    help="MLX provider option key=value (repeatable), e.g. device=cpu, no_compile=1")
    ap.add_argument("--sample", action="store_true", help="sample (genai_config.json's search options) instead of greedy")
    ap.add_argument("--report", action="store_true", help="print the MLX partition report")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")

    import onnxruntime_genai as og
    t0 = time.perf_counter()
    model, reports = mg.load_model(args.model_dir, args.provider, options=dict(args.option) or None)
    load_s = time.perf_counter() - t0
    if args.report:
        for r in reports:
            print(r.format(), file=sys.stderr)
    if args.provider == "mlx":
        if not reports:
            print("WARNING: the MLX EP made no partition report (GetCapability failed? see the log above): "
                  "everything runs on the CPU EP", file=sys.stderr)
        elif reports[-1].unclaimed:
            r = reports[-1]
            print(f"note: {len(r.unclaimed)} of {r.n_nodes} nodes run on the CPU EP (--report says why)",
                  file=sys.stderr)
    tok = og.Tokenizer(model)
    ids = tok.encode(args.prompt)
    params = og.GeneratorParams(model)
    opts = {"max_length": len(ids) + args.max_new_tokens}
    if not args.sample:
        opts.update(do_sample=False, num_beams=1)
    else:
        opts.update(do_sample=True)
    params.set_search_options(**opts)
    gen = og.Generator(model, params)
    stream = tok.create_stream()
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    t1 = time.perf_counter()
    gen.append_tokens(ids)
    t_first = None
    n = 0
    while not gen.is_done():
        gen.generate_next_token()
        t = int(gen.get_next_tokens()[0])
        n += 1
        if t_first is None:
            t_first = time.perf_counter() - t1
        sys.stdout.write(stream.decode(t))
        sys.stdout.flush()
    total = time.perf_counter() - t1
    rest = total - (t_first or 0.0)
    print(file=sys.stdout)
    print(f"[{args.provider}] load {load_s:.2f}s, prompt {len(ids)} tokens, first token {1e3 * (t_first or 0):.1f} ms, "
          f"{n} tokens in {total:.2f}s ({(n - 1) / rest if n > 1 and rest > 0 else float('nan'):.1f} tok/s after the first)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far a half-precision LLM graph's answer is from float32, on the MLX EP and on ORT's CPU EP, side by side.

    python scripts/half_error_probe.py models/out/qwen2-tiny-fp16-cuda --seeds 10     # logits, 10 random prompts
    python scripts/half_error_probe.py models/out/qwen2-tiny-fp16-cuda --nodes        # every node's output, 1 prompt
    python scripts/half_error_probe.py MODEL_DIR --env ORTMLX_TUNING=fold_bias=0      # an A/B: set before import
    python scripts/half_error_probe.py MODEL_DIR --device gpu --cuda --nodes          # next to ORT's CUDA EP

One prompt of ``--tokens`` random ids (no past) runs through the genai model's graph: ORT's CPU EP on the graph
cast to float32 (``arch_cases.float32_graph``) is the reference; the MLX EP (device ``--device``) and ORT's CPU
EP each run the half graph. Each distance is max |EP - reference| / max |reference|; the ratio is MLX EP / CPU EP
(DEVELOPERS.md's half-precision check, with ORT's CPU EP where no CUDA EP is; ``--cuda`` adds ORT's CUDA EP on the
half graph, and the ratio is then MLX EP / CUDA EP, the policy's bound). ``--nodes`` exposes every node's
output as a graph output, so passes that fold a node into the next (``fold_bias``) do not apply there.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a genai model folder (fp16/bf16 graph: models/build_llm.py --target cuda)")
    ap.add_argument("--seeds", type=int, default=1, help="random prompts (logits only, unless --nodes)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--nodes", action="store_true", help="every node's output, not only the logits")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="the MLX EP's device")
    ap.add_argument("--cuda", action="store_true", help="also ORT's CUDA EP on the half graph (the ratio's bound)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set before ortmlx is imported")
    args = ap.parse_args(argv)
    for kv in args.env:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    import numpy as np
    import onnx
    import onnxruntime as ort

    sys.path.insert(0, HERE)
    import arch_cases

    import ortmlx
    ortmlx.register()
    cfg = json.load(open(os.path.join(args.model, "genai_config.json")))["model"]["decoder"]
    tmp = tempfile.mkdtemp(prefix="half_probe_")
    try:
        d32 = arch_cases.float32_graph(args.model, os.path.join(tmp, "f32"))
        d16 = os.path.join(tmp, "half")
        shutil.copytree(args.model, d16)
        p32, order = _exposed(onnx, d32, args.nodes)
        p16, _ = _exposed(onnx, d16, args.nodes)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        engines = [("ref", p32, ["CPUExecutionProvider"]), ("cpu", p16, ["CPUExecutionProvider"]),
                   ("mlx", p16, [("MLXExecutionProvider", {"device": args.device})])]
        if args.cuda:
            engines.append(("cuda", p16, ["CUDAExecutionProvider"]))
        sessions = {name: ort.InferenceSession(p, so, providers=prov) for name, p, prov in engines}
        if args.cuda and "CUDAExecutionProvider" not in sessions["cuda"].get_providers():
            raise SystemExit("--cuda: ORT's CUDA EP is not available in this onnxruntime")
        bound = "cuda" if args.cuda else "cpu"
        ratios = []
        for seed in range(args.seeds):
            feeds = _feeds(np, sessions["cpu"], cfg, args.tokens, seed)
            res = {}
            for name, s in sessions.items():
                f = {k: (v.astype(np.float32) if name == "ref" and v.dtype == np.float16 else v) for k, v in feeds.items()}
                res[name] = dict(zip([o.name for o in s.get_outputs()], s.run(None, f)))
            rows = order + [("logits", "-", "logits")] if args.nodes else [("logits", "-", "logits")]
            for out, op, node in rows:
                r = res["ref"].get(out)
                if r is None or out not in res["mlx"] or not np.issubdtype(r.dtype, np.floating) or not r.size:
                    continue
                a, c = _rel(np, res["mlx"][out], r), _rel(np, res["cpu"][out], r)
                b = _rel(np, res["cuda"][out], r) if args.cuda else c
                ratio = a / b if b else float("inf")
                if out == "logits":
                    ratios.append(ratio)
                label = f"seed {seed}" if not args.nodes else node[-60:]
                cuda = f"  CUDA EP {b:9.2e}" if args.cuda else ""
                print(f"{label:60s} {op:32s} MLX EP {a:9.2e}  CPU EP {c:9.2e}{cuda}  ratio {ratio:5.2f}")
        if len(ratios) > 1:
            print(f"logits over {len(ratios)} prompts: ratio MLX EP / {bound.upper()} EP median {statistics.median(ratios):.2f}, "
                  f"max {max(ratios):.2f}, above 1.0 in {sum(r > 1 for r in ratios)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _exposed(onnx, folder: str, every_node: bool):
    """The folder's graph saved as exposed.onnx, with every node's output a graph output when ``every_node``."""
    m = onnx.load(os.path.join(folder, "model.onnx"))
    have = {o.name for o in m.graph.output}
    order = []
    for n in m.graph.node:
        for o in n.output:
            if o and o not in have:
                order.append((o, n.op_type, n.name))
                if every_node:
                    m.graph.output.append(onnx.ValueInfoProto(name=o))
    p = os.path.join(folder, "exposed.onnx")
    onnx.save(m, p, save_as_external_data=True, all_tensors_to_one_file=True, location="exposed.onnx.data")
    return p, order


def _feeds(np, sess, cfg: dict, tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    half = np.float16
    out = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            out[i.name] = rng.integers(0, 500, (1, tokens)).astype(np.int64)
        elif i.name == "attention_mask":
            out[i.name] = np.ones((1, tokens), np.int64)
        elif i.name == "position_ids":
            out[i.name] = np.arange(tokens, dtype=np.int64)[None]
        elif "past" in i.name:
            if "float16" not in i.type:
                raise SystemExit(f"{i.name} is {i.type}: the probe feeds float16 past buffers only")
            out[i.name] = np.zeros((1, cfg["num_key_value_heads"], 0, cfg["head_size"]), half)
        else:
            raise SystemExit(f"input {i.name}: not a genai decoder input the probe knows")
    return out


def _rel(np, x, r) -> float:
    r = np.asarray(r, np.float64)
    return float(np.abs(np.asarray(x, np.float64) - r).max() / max(np.abs(r).max(), 1e-30))


if __name__ == "__main__":
    sys.exit(main())

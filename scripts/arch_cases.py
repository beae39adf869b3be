"""One arch x target x precision case of docs/llm_partition.md's architecture table, measured.

    python scripts/arch_cases.py gemma2 cpu fp32 [--n 64] [--device cpu|gpu] [--json out.json]

Loads models/out/<case> through genai on the MLX EP (``ortmlx.register()``), records the partition
report the EP made (nodes on MLX / total, groups, what is left on the CPU EP and why), generates ``--n``
greedy tokens and compares them with the reference, and records what the compiled decode path did
(the decode closure's traces and replays, or the reason it ran eagerly).

References (the correctness policy, docs/llm_partition.md):
- ``-e cpu`` fp32: genai on ORT's CPU EP, the same model.
- ``-e cpu`` int4/int8: the CPU EP on a copy with every MatMulNBits / QMoE at accuracy_level 0 (the
  builder's level 4 quantizes activations to int8 there; MLX computes in float).
- ``-e cuda`` fp16/bf16 (ORT's CPU EP has no bf16 kernels, and its fp16 ones round differently): the
  same graph cast to float32 on the CPU EP; where the CPU EP cannot run even that (q/k norm inputs,
  which it refuses), the fp32 ``-e cpu`` build of the same checkpoint. Half precision is not expected to give the
  same 64 greedy tokens as float32 (a near-tie flips), so the case also records the teacher-forced
  logits' max |MLX - reference| / max |reference| over 16 steps, bounded by HALF_RTOL. Token identity
  for these graphs is the GPU's job (``--device gpu``, on a CUDA host, with onnxruntime-genai-cuda): there
  ORT's CUDA EP runs the same graph too, the tokens are compared with its, and its teacher-forced distance
  to the float32 reference is the bound for the MLX EP's (DEVELOPERS.md's half-precision policy); on the
  CPU that cell is "not run here".
Run by scripts/llm_report.py, one process per case (a crash costs one cell).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "models"))

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
#: teacher-forced logits of a half-precision graph on MLX vs the fp32 build on the CPU EP:
#: max |diff| <= HALF_RTOL * max |reference| (fp16: 10 mantissa bits, ~1e-3 a rounding, through two
#: layers and the lm head; bf16: 7 bits, ~8x coarser). Measured values are in the table.
HALF_RTOL = {"fp16": 2e-2, "bf16": 1e-1}
N_FORCED = 16


def level0(path: str, dst: str) -> str:
    """Copy of a genai model with every MatMulNBits / QMoE accuracy_level set to 0 (float on the CPU EP)."""
    import onnx

    from ortmlx import genai as mg
    mg.variant_dir(path, dst)
    m = onnx.load(os.path.join(dst, "model.onnx"), load_external_data=False)
    n = 0
    for node in m.graph.node:
        if node.op_type in ("MatMulNBits", "QMoE"):
            for at in node.attribute:
                if at.name == "accuracy_level":
                    at.i = 0
                    n += 1
    onnx.save(m, os.path.join(dst, "model.onnx"))
    return dst


def float32_graph(path: str, dst: str) -> str:
    """Copy of a genai model whose float16/bfloat16 graph is cast to float32: initializers, Constant /
    ConstantOfShape values, graph inputs/outputs/value_info and Cast targets (the same graph in float32,
    which ORT's CPU EP runs where it has the ops: its reference for half-precision graphs)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, numpy_helper

    from ortmlx import genai as mg
    mg.variant_dir(path, dst, strip_value_info=True)
    f = os.path.join(dst, "model.onnx")
    m = onnx.load(f)
    half = (TensorProto.FLOAT16, TensorProto.BFLOAT16)

    def to32(t):
        if t.data_type not in half:
            return t
        if t.data_type == TensorProto.BFLOAT16:
            raw = np.frombuffer(t.raw_data, np.uint16) if t.raw_data else np.asarray(t.int32_data, np.uint16)
            a = (raw.astype(np.uint32) << 16).view(np.float32).reshape(tuple(t.dims))
        else:
            a = numpy_helper.to_array(t).astype(np.float32)
        return numpy_helper.from_array(a, t.name)

    def graph(g):
        for i, t in enumerate(g.initializer):
            g.initializer[i].CopyFrom(to32(t))
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.tensor_type.elem_type in half:
                vi.type.tensor_type.elem_type = TensorProto.FLOAT
        for node in g.node:
            for at in node.attribute:
                if node.op_type == "Cast" and at.name == "to" and at.i in half:
                    at.i = TensorProto.FLOAT
                if at.type == onnx.AttributeProto.TENSOR:
                    at.t.CopyFrom(to32(at.t))
                if at.type == onnx.AttributeProto.GRAPH:
                    graph(at.g)
    graph(m.graph)
    onnx.save(m, f, save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data")
    return dst


def agree(a, b) -> int:
    """The first position where two token lists differ (their common length when they do not)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _decode_summary(runners) -> dict:
    """What the compiled decode path did: traces, replays, eager calls and the reasons it gave."""
    att = [r for r in runners if hasattr(r, "decode")]
    out = {"groups": len(runners), "attention_groups": len(att), "parts": []}
    for r in runners:
        parts = r.parts() if hasattr(r, "parts") else [r]
        for p in parts:
            c = p.counters
            out["parts"].append({
                "label": c.get("compiled"), "traces": p.trace_counts(), "compiled_calls": c.get("compiled_calls", 0),
                "eager_calls": c.get("eager_calls", 0), "verify_calls": c.get("verify_calls", 0),
                "guard_fails": c.get("guard_fails", 0), "poisoned": c.get("poisoned"),
                "static_reason": getattr(p, "static_reason", None),
                # the reasons the closure gave for answering eagerly (its fallback messages)
                "reasons": sorted(getattr(p, "_said", ()))[:4]})
    return out


def run_case(arch: str, target: str, precision: str, n: int = 64, device: str = "cpu",
             models_out: str | None = None) -> dict:
    import build_llm as bl
    import onnxruntime_genai as og

    import ortmlx.compiled as C
    from ortmlx import genai as mg

    root = models_out or bl.OUT_ROOT
    name = bl.model_name(arch, "tiny", precision, target)
    path = os.path.join(root, name)
    res: dict = {"name": name, "arch": arch, "target": target, "precision": precision, "device": device}
    if not os.path.exists(os.path.join(path, "model.onnx")):
        res["not_built"] = bl.failure(path) or "not built (run models/build_llm.py --all-archs)"
        return res
    # kernels built behind the calls (CPU) would make the decode column depend on the builder's speed
    opts = {"device": device, "tuning": "build_behind=0"}
    with C.capture() as runners:
        model, reports = mg.load_model(path, "mlx", opts)
    rep = mg.main_report(reports)
    res.update(nodes=rep.n_nodes, on_mlx=rep.n_claimed, groups=len(rep.groups),
               left=[[op, reason, k] for (op, reason), k in Counter((u.op, u.reason) for u in rep.unclaimed).items()],
               report=rep.format())
    ids = [int(t) for t in og.Tokenizer(model).encode(PROMPT)]
    res["prompt_tokens"] = len(ids)
    got = mg.greedy(model, ids, n)
    res["decode"] = _decode_summary(runners)
    if not runners:     # the group runs as a plain Program: compiled.choose() gave a reason
        import onnx
        ops = {n.op_type for n in onnx.load(os.path.join(path, "model.onnx"), load_external_data=False).graph.node}
        flow = sorted(ops & {"If", "Loop", "Scan"})
        res["decode"]["static"] = (f"{flow[0]}: control-flow node in the group (its bodies run eagerly, the "
                                   "group is never traced)" if flow else "the group is not compiled")
    half = target == "cuda" or precision in ("fp16", "bf16")
    with tempfile.TemporaryDirectory() as tmp:
        if not half:
            ref_path = level0(path, os.path.join(tmp, name)) if precision in ("int4", "int8") else path
            res["reference"] = "CPU EP, same model" + (" at accuracy_level 0" if ref_path != path else "")
            ref_model = mg.load_model(ref_path, "cpu")[0]
            ref = mg.greedy(ref_model, ids, n)
            res["agree"] = agree(got, ref)
            res["distinct_ref_tokens"] = len(set(ref))
            return res
        forced_ref = None
        try:      # the same graph in float32 on the CPU EP
            ref_model = mg.load_model(float32_graph(path, os.path.join(tmp, name + "-f32")), "cpu")[0]
            ref = mg.greedy(ref_model, ids, n)
            res["reference"] = "CPU EP on this graph cast to float32"
        except Exception as e:  # noqa: BLE001 - ORT's CPU EP lacks an op/input of this graph
            res["float32_graph_error"] = str(e).strip().splitlines()[0][:300]
            ref_path = os.path.join(root, bl.model_name(arch, "tiny", "fp32", "cpu"))
            if not os.path.exists(os.path.join(ref_path, "model.onnx")):
                res["reference_missing"] = True
                return res
            res["reference"] = (f"CPU EP on {os.path.basename(ref_path)} (the fp32 -e cpu build: the CPU EP "
                                "cannot run this graph in float32)")
            ref_model = mg.load_model(ref_path, "cpu")[0]
            ref = mg.greedy(ref_model, ids, n)
        res["agree_vs_fp32"] = agree(got, ref)
        forced_ref = ref[:N_FORCED]
        a = mg.forced_logits(model, ids, forced_ref)
        b = mg.forced_logits(ref_model, ids, forced_ref)
        res["logits_rel"] = _rel(a, b)
        res["steps_rel"] = _steps(a, b)
        res["half_rtol"] = HALF_RTOL.get(precision, HALF_RTOL["fp16"])
        try:      # the CPU EP on the same half graph, where it has the kernels (float16; no bfloat16 ones)
            cpu_half = mg.load_model(path, "cpu")[0]
            c = mg.forced_logits(cpu_half, ids, forced_ref)
            res["logits_rel_cpu_half"] = _rel(a, c)
            res["cpu_half_vs_fp32"] = _rel(c, b)
        except Exception as e:  # noqa: BLE001
            res["cpu_half_error"] = str(e).strip().splitlines()[0][:200]
        if device == "gpu":
            res.update(cuda_reference(path, ids, n, got, ref, forced_ref, a, b))
    return res


def _steps(xs, ys) -> list[float]:
    """max |x - y| / max |y| at each teacher-forced step (the first is the prompt's)."""
    import numpy as np
    return [float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(xs, ys)]


def _rel(xs, ys) -> float:
    """max |x - y| / max |y| over teacher-forced steps."""
    return max(_steps(xs, ys))


def _gpu_name() -> str:
    import subprocess
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return ""


def cuda_reference(path, ids, n, got, ref, forced, mlx_logits, ref_logits) -> dict:
    """ORT's CUDA EP on the same half-precision graph: the GPU's reference (DEVELOPERS.md: the MLX EP's
    distance to float32 may be no larger than the CUDA EP's; greedy tokens against the CUDA EP)."""
    import numpy as np
    import onnxruntime as ort
    import onnxruntime_genai as og

    from ortmlx import genai as mg
    out = {"versions": {"onnxruntime": ort.__version__, "onnxruntime_genai": og.__version__}, "gpu": _gpu_name()}
    try:
        model = mg.load_model(path, "cuda")[0]
        toks = mg.greedy(model, ids, n)
        c = mg.forced_logits(model, ids, forced)
    except Exception as e:  # noqa: BLE001 - ORT's CUDA EP refuses this graph: said in the cell
        out["cuda_error"] = str(e).strip().splitlines()[0][:300]
        return out
    out["finite"] = bool(all(np.isfinite(x).all() for x in list(c) + list(mlx_logits)))
    out["agree"] = agree(got, toks)                 # the tokens cell on the GPU: MLX EP vs CUDA EP
    out["cuda_agree_vs_fp32"] = agree(toks, ref)
    out["cuda_vs_fp32"] = _rel(c, ref_logits)
    out["cuda_steps_rel"] = _steps(c, ref_logits)
    out["mlx_vs_cuda"] = _rel(mlx_logits, c)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch")
    ap.add_argument("target", choices=("cpu", "cuda"))
    ap.add_argument("precision")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--models-out", default=None)
    ap.add_argument("--json", default=None, help="write the result here (default: print it)")
    args = ap.parse_args(argv)
    res = run_case(args.arch, args.target, args.precision, args.n, args.device, args.models_out)
    text = json.dumps(res, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

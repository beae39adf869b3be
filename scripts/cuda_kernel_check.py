"""Compile-check the custom CUDA kernels (``ortmlx/kernels/cuda_kernels.py``, ``cuda_rows.py``,
``cuda_recurrent.py``) without a GPU.

    python scripts/cuda_kernel_check.py [--nvrtc LIBNVRTC] [--include DIR ...] [--arch sm_90a]

Each kernel's source is assembled as MLX's ``cuda_kernel`` assembles it and compiled with NVRTC as
``kernels/cuda_cache.py`` builds it for MLX's kernel cache (MLX's flags, the stand-in for MLX's device header):
for float16, bfloat16 and float32 with representative template values. NVRTC and the headers come from PyPI's
``nvidia-cuda-nvrtc`` / ``nvidia-cuda-runtime`` 13 wheels and the ``mlx-cuda-13`` wheel's ``mlx/include``
(found beside an installed MLX CUDA build, else give ``--nvrtc`` and three ``--include``: MLX's include
directory, its ``cccl`` directory, the CUDA runtime's include directory). Any error fails (exit 1).
A compile check is not a test: the kernels' behaviour is tested on a GPU (``tests/test_cuda_kernels.py``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

if importlib.util.find_spec("ortmlx") is None:      # a checkout run without an installed ortmlx
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cases():
    from ortmlx.kernels import cuda_kernels as ck
    from ortmlx.kernels import cuda_rows as cr
    attn_in = ["q", "k", "v", "past_len", "total_len", "sink"]
    fused_in = ["qsrc", "ksrc", "vsrc", "cosv", "sinv", "past_k", "past_v", "past_len", "total_len", "sink", "bias"]
    for t in ("float16", "bfloat16", "float32"):
        for sink, win, head, cap in ((False, 0, 64, 0.0), (True, 16, 80, 5.0), (False, 0, 256, 0.0)):
            yield (f"decode_attention {t} head {head} sink {sink} window {win}", "ortmlx_decode_attention_x", attn_in,
                   [t, t, t, "int32", "int32", "float32"], ["out"], [t], ck._ATTN_SOURCE, ck._attn_header(0.125, cap),
                   [("T", t), ("NH", 14), ("NKV", 2), ("HEAD", head), ("QH", 18), ("KV", 160),
                    ("WARPS", ck.ATTN_WARPS), ("KEYS", ck.ATTN_KEYS), ("WINDOW", win), ("HAS_SINK", sink)])
        for rot, inter, bias, head in ((64, False, True, 64), (32, True, False, 64), (0, False, False, 80),
                                       (32, False, False, 36)):
            crows = ck.fused_rows_per_block(head, 4 if t == "float32" else 2, 32 * ck.ATTN_WARPS)
            yield (f"decode_rope_attention {t} head {head} rotary {rot} interleaved {inter} bias {bias}",
                   "ortmlx_decode_rope_attention_x", fused_in,
                   [t, t, t, "float32", "float32", t, t, "int32", "int32", "float32", t],
                   ["out", "present_k", "present_v", "k_new", "v_new"], [t] * 5, ck._FUSED_SOURCE,
                   ck._attn_header(0.125, 0.0) + ck._ROPE_HEADER,
                   [("T", t), ("NB", 1), ("NH", 14), ("NKV", 2), ("HEAD", head), ("KV", 160),
                    ("WARPS", ck.ATTN_WARPS), ("KEYS", ck.ATTN_KEYS), ("WINDOW", 0), ("HAS_SINK", bias),
                    ("ROT_DIM", rot), ("INTERLEAVED", inter), ("CROWS", crows), ("HAS_QKV_BIAS", bias), ("Q_ROW", 1152), ("Q_OFF", 0),
                    ("K_ROW", 1152), ("K_OFF", 896), ("V_ROW", 1152), ("V_OFF", 1024)])
        for sink, win, head, cap in ((False, 0, 64, 0.0), (True, 16, 80, 5.0), (False, 0, 256, 0.0)):
            yield (f"prompt_attention {t} head {head} sink {sink} window {win}", "ortmlx_prompt_attention_x",
                   ["q", "k", "v", "total_len", "sink"], [t, t, t, "int32", "float32"], ["out"], [t],
                   ck._PROMPT_SOURCE, ck._attn_header(0.125, cap),
                   [("T", t), ("NH", 14), ("NKV", 2), ("HEAD", head), ("WARPS", ck.ATTN_WARPS),
                    ("KEYS", ck.ATTN_KEYS), ("WINDOW", win), ("HAS_SINK", sink), ("DROP_PAST", not sink)])
        for rot, inter, bias, valid, head, rows in ((64, False, True, True, 64, 4104), (32, True, False, False, 64, 0),
                                                    (0, False, False, True, 80, 0)):
            yield (f"prompt_rope {t} head {head} rotary {rot} interleaved {inter} bias {bias} valid {valid}",
                   "ortmlx_prompt_rope_x", ["qkv", "cosv", "sinv", "valid", "bias"],
                   [t, "float32", "float32", "int32", t],
                   ["q_out", "present_k", "present_v", "k_rows", "v_rows"], [t] * 5, ck._PROMPT_ROPE_SOURCE,
                   ck._ROPE_HEADER,
                   [("T", t), ("NH", 14), ("NKV", 2), ("HEAD", head), ("ROWS", rows), ("ROT_DIM", rot),
                    ("INTERLEAVED", inter), ("HAS_QKV_BIAS", bias), ("HAS_VALID", valid)])
        for skip, bias in ((True, False), (True, True), (False, False)):
            yield (f"rms_norm {t} skip {skip} bias {bias}", "ortmlx_rms_norm_x", ["x", "skip", "bias", "gamma"],
                   [t] * 4, ["out", "sum"], [t, t], ck._NORM_SOURCE,
                   f"constexpr float EPS = {ck._f32_literal(1e-6)};\n",
                   [("T", t), ("HIDDEN", 896), ("HAS_SKIP", skip), ("HAS_BIAS", bias)])
        for gate_first in (True, False):
            yield (f"swiglu {t} gate first {gate_first}", "ortmlx_swiglu_x", ["y"], [t], ["out"], [t],
                   ck._SWIGLU_SOURCE, "", [("T", t), ("N", 4864), ("GATE_FIRST", gate_first)])
        for k, n, wnd, skip, bias, gated in ((896, 1152, 3, True, False, None), (1536, 17920, 3, True, True, None),
                                             (100, 24, 2, False, False, None), (896, 4864, 3, True, False, True),
                                             (1536, 8960, 3, True, True, False), (100, 12, 2, False, False, True)):
            tpr = cr.threads_per_output(k, 4 if t == "float32" else 8)
            rb = cr.rows_per_block(16, k, 4 if t == "float32" else 2)
            yield (f"norm_gemv {t} K {k} N {n} skip {skip} bias {bias} gated {gated} rows {rb}", "ortmlx_norm_gemv_x",
                   ["x", "skip", "bias", "gamma", "w"], [t] * 5, ["out", "sum"], [t, t], cr.NORM_SOURCE,
                   f"constexpr float EPS = {ck._f32_literal(1e-6)};\n",
                   [("T", t), ("HAS_SKIP", skip), ("HAS_BIAS", bias), ("XND", 3), ("WND", wnd),
                    ("GATED", gated is not None), ("GATE_FIRST", gated is not False), ("K", k), ("N", n),
                    ("TPR", tpr), ("THREADS", cr.THREADS), ("RB", rb), ("NR", 16)])
        for k, n, gate_first in ((4864, 896, True), (8960, 1536, False), (36, 40, True)):
            tpr = cr.threads_per_output(k, 4 if t == "float32" else 8)
            yield (f"swiglu_gemv {t} K {k} N {n}", "ortmlx_swiglu_gemv_x", ["y", "w"], [t, t], ["out"], [t],
                   cr.SWIGLU_SOURCE, "", [("T", t), ("GATE_FIRST_ROW", gate_first), ("YND", 3), ("WND", 3),
                                          ("GATED", False), ("GATE_FIRST", True), ("K", k), ("N", n),
                                          ("TPR", tpr), ("THREADS", cr.THREADS), ("RB", 1), ("NR", 1)])
        for k, n, rnd in ((4864, 896, 3), (8960, 1536, 3), (36, 40, 1)):
            tpr = cr.threads_per_output(k, 4 if t == "float32" else 8)
            yield (f"row_gemv {t} K {k} N {n}", "ortmlx_row_gemv_x", ["a", "w"], [t, t], ["out"], [t],
                   cr.ROW_SOURCE, "", [("T", t), ("AND_", rnd), ("WND", 3), ("GATED", False), ("GATE_FIRST", True),
                                       ("K", k), ("N", n), ("TPR", tpr), ("THREADS", cr.THREADS),
                                       ("RB", cr.rows_per_block(4, k, 4 if t == "float32" else 2)), ("NR", 4)])
    for t in ("float16", "bfloat16", "float32"):
        for it in ("int32", "int64"):
            yield (f"take_rows {t} {it}", "ortmlx_take_rows_x", ["data", "idx"], [t, it], ["out"], [t],
                   ck._TAKE_SOURCE, "", [("T", t), ("A", 0)])
    for s, bits, zp, it in (("float16", 4, True, "int64"), ("float32", 4, False, "int32"),
                            ("float16", 8, True, "int32")):
        yield (f"take_dequant_rows {s} {bits}-bit zero points {zp} {it}", "ortmlx_take_dequant_rows_x",
               ["data", "scales", "zero_points", "idx"], ["uint8", s, "uint8", it], ["out"], [s],
               ck._DEQUANT_TAKE_SOURCE, "", [("S", s), ("K", 1), ("COLS", 896), ("N", 151936), ("ROW", 896 * bits // 8),
                                              ("BITS", bits), ("BLOCK", 32), ("KB", 28), ("ZROW", 28 * bits // 8),
                                              ("HAS_ZP", zp)])
    for t, pos, inter in (("float16", "int64", False), ("float32", "int32", True), ("bfloat16", "int32", False)):
        yield (f"decode_setup {t} positions {pos} interleaved {inter}", "ortmlx_decode_setup_x",
               ["seqlens", "pos", "cos_cache", "sin_cache"], ["int32", pos, t, t],
               ["past_len", "total_len", "cos_row", "sin_row"], ["int32", "int32", "float32", "float32"],
               ck._SETUP_SOURCE, "", [("NB", 1), ("HEAD", 64), ("HALF", 32), ("ROWS", 4104), ("HAS_POS", True),
                                      ("INTERLEAVED", inter)])
    from ortmlx.kernels import cuda_replay
    n = cuda_replay.DESCRIBE_CHUNK
    yield (f"describe {n} arrays", "ortmlx_describe_x", [f"a{i}" for i in range(n)], ["float16", "int32"] * (n // 2),
           ["info"], ["int64"], cuda_replay._describe_source(n), "", [])
    parts = 49
    yield ("gather_bytes 49 arrays", "ortmlx_gather_bytes_x", [f"in{i}" for i in range(parts)] + ["table"],
           ["float16"] * 48 + ["int32", "int64"], ["out"], ["uint8"], ck._gather_source(parts), "", [])
    yield ("gather_bytes 49 arrays to host memory", "ortmlx_gather_host_x",
           [f"in{i}" for i in range(parts)] + ["table", "sink"], ["float16"] * 48 + ["int32", "int64", "uint64"],
           ["out"], ["uint8"], ck._gather_source(parts, to_host=True), "", [])
    for t in ("float16", "float32"):
        yield (f"copy_to_host {t}", "ortmlx_copy_host_x", ["src", "sink"], [t, "uint64"], ["done"], ["uint8"],
               ck._COPY_HOST.replace("NBYTES", "303872ull"), "", [])
        yield (f"copy_to_address {t}", "ortmlx_copy_any_x", ["src", "sink"], [t, "uint64"], ["done"], ["uint8"],
               ck._COPY_ANY, "", [])
    yield ("copy_from_address", "ortmlx_copy_in_x", ["stage", "limit"], ["uint64", "uint8"], ["out"], ["uint8"],
           ck._COPY_IN, "", [])
    from ortmlx.kernels import cuda_recurrent as rec
    for cell, h, d, rev, lens, clip in (("lstm", 256, 2, False, False, None), ("lstm", 20, 1, True, True, 0.5),
                                        ("gru", 128, 2, False, True, None), ("gru", 13, 1, True, False, 0.3),
                                        ("gru_early", 256, 2, False, True, None), ("rnn", 64, 2, True, True, 0.2)):
        nb, units = rec.blocks(h)
        yield (f"recurrence {cell} H {h} directions {d} lens {lens} clip {clip}", "ortmlx_recurrence_x", rec.INPUTS,
               ["float32"] * 5 + ["int32"], rec.OUTPUTS, ["float32", "float32", "uint32"], rec.SOURCE,
               rec.header(clip), rec.template(cell, h, d, units, rev, lens))


def check_all(nvrtc, includes: list[str], arch: str = "sm_90a", quiet: bool = False) -> int:
    """Compile every case; the number with errors or warnings."""
    from ortmlx.kernels import cuda_cache as cc
    from ortmlx.kernels.cuda_kernels import with_prior_wait
    opts = cc.nvrtc_options(arch, includes)
    bad = 0
    for label, name, ins, in_t, outs, out_t, src, head, tmpl in cases():
        src = with_prior_wait(src)          # (as ``cuda_kernels._kernel`` builds it)
        func = cc.kernel_name(name, tmpl)
        text = cc.mlx_source(func, head, src, ins, [(t, 2) for t in in_t], outs, out_t, tmpl)
        try:
            nvrtc.compile(text, cc.module_name(func, text) + ".cu", "mlx::core::cu::" + func, opts,
                          cc.HEADERS)
            ok, log = True, ""
        except cc.NvrtcError as e:
            ok, log = False, str(e)
        bad += not ok
        if not quiet or not ok:
            print(f"{'ok ' if ok else 'BAD'} {label}")
            for ln in log.splitlines()[:6]:
                print(f"    {ln}")
    if not quiet:
        print(f"{bad} kernel(s) with errors")
    return bad


def main(argv=None) -> int:
    from ortmlx.kernels import cuda_cache as cc
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvrtc", help="libnvrtc.so path (default: the one loaded by MLX, else the nvidia wheel's)")
    ap.add_argument("--include", action="append", default=[], help="an include directory (default MLX's)")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args(argv)
    lib = args.nvrtc or cc.loaded_nvrtc() or cc.wheel_nvrtc()
    if lib is None:
        print("cuda_kernel_check: no libnvrtc found: pip install nvidia-cuda-nvrtc, or give --nvrtc")
        return 2
    return 1 if check_all(cc.Nvrtc(lib), args.include or cc.include_paths(), args.arch) else 0


if __name__ == "__main__":
    sys.exit(main())

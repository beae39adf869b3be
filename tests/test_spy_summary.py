"""scripts/spy_summary.py: the samples it keeps and the shares it gives, on a made-up folded profile."""
from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("spy_summary", os.path.join(HERE, "scripts", "spy_summary.py"))
spy_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spy_summary)

PROFILE = """\
<module> (a.py:1);ComputeInfo.compute (compute.py:9);CompiledSubgraph._apply (core.py:3);mlx::core::eval_impl (libmlx.so) 6
<module> (a.py:1);ComputeInfo.compute (compute.py:9);ComputeInfo.copy_out (compute.py:5) 2
<module> (a.py:1);ComputeInfo.compute (compute.py:9);CompiledSubgraph._first (core.py:7);nvrtcCompileProgram (x.so) 50
<module> (a.py:1);genai_step (g.py:2);0x7f00 (libc.so.6) 9

"""


def test_keeps_steady_compute_samples_and_shares_them():
    n, incl, leaves = spy_summary.summarise(PROFILE.splitlines(True), "ComputeInfo.compute", ["_first", "nvrtc"])
    assert n == 8
    assert incl["ComputeInfo.compute"] == 8 and incl["mlx::core::eval_impl"] == 6 and incl["ComputeInfo.copy_out"] == 2
    assert "nvrtcCompileProgram" not in incl and "genai_step" not in incl
    assert leaves["mlx::core::eval_impl <- CompiledSubgraph._apply <- ComputeInfo.compute"] == 6


def test_main_prints_and_says_when_nothing_matched(tmp_path, capsys):
    f = tmp_path / "spy.txt"
    f.write_text(PROFILE)
    assert spy_summary.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "8 samples" in out and "75.0%  mlx::core::eval_impl" in out
    assert spy_summary.main([str(f), "--within", "NoSuchFrame"]) == 1
    assert "no samples" in capsys.readouterr().out

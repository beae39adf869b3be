"""docs/operators.md must match the translator registry (regenerate: python scripts/gen_operators_doc.py)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gen_operators_doc.py")


def test_operators_doc_is_current():
    p = subprocess.run([sys.executable, SCRIPT, "--check"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_check_detects_stale_file(tmp_path):
    stale = tmp_path / "operators.md"
    stale.write_text("# Operators\n")
    p = subprocess.run([sys.executable, SCRIPT, "--check", "--out", str(stale)], capture_output=True, text=True)
    assert p.returncode == 1 and "stale" in p.stderr, p.stdout + p.stderr


def test_doc_lists_every_registration(tmp_path):
    out = tmp_path / "operators.md"
    subprocess.run([sys.executable, SCRIPT, "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    text = out.read_text()
    sys.path.insert(0, ROOT)
    import ortmlx.kernels  # noqa: F401
    from ortmlx.kernels.registry import REGISTRY
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| op |")]
    regs = list(REGISTRY)
    assert len(rows) == len(regs)
    for d in regs:
        assert any(r.startswith(f"| {d.op_type} | {d.since}") for r in rows), d.key

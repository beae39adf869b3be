"""The layers import one way (docs/architecture.md): every import in ortmlx, function-local ones included, points
to its own layer or one below it, and no two packages import each other."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ortmlx"

#: bottom to top; a module belongs to the first layer whose prefix it has
LAYERS = [
    ("base", ("ortmlx.errors", "ortmlx.tuning", "ortmlx.version", "ortmlx.ir", "ortmlx.trace", "ortmlx.stats",
              "ortmlx.blas", "ortmlx._blasfwd", "ortmlx._build_blas")),
    ("kernels", ("ortmlx.kernels",)),
    ("subgraph", ("ortmlx.subgraph",)),
    ("compiled", ("ortmlx.compiled",)),
    ("runtime", ("ortmlx.runtime",)),
    ("ep", ("ortmlx.ep",)),
    ("top", ("ortmlx",)),           # the package's front: register(), genai, testing, fuzz, the command line
]


def layer(module: str) -> int:
    for k, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return k
    raise AssertionError(f"{module} is in no layer")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported ortmlx module, line) for every import in the file, resolved to absolute names."""
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "ortmlx"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ortmlx":
                continue
            # ``from pkg import sub``: the submodule when it is one
            for a in node.names:
                sub = f"{target}.{a.name}"
                p = PKG.parent / Path(*sub.split("."))
                # a built extension (the cffi modules) is named in LAYERS: a fresh clone has no .so in place
                is_mod = p.with_suffix(".py").exists() or (p / "__init__.py").exists() or \
                    any(sub in prefixes for _, prefixes in LAYERS)
                out.append((sub if is_mod else target, node.lineno))
    return out


def test_imports_point_down():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        me = layer(mod)
        for target, line in imports(path):
            if target == "ortmlx" and LAYERS[me][0] != "top":
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports the package front 'ortmlx'")
            elif layer(target) > me:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} ({LAYERS[me][0]}) imports {target} "
                           f"({LAYERS[layer(target)][0]})")
    assert not bad, "imports pointing up:\n" + "\n".join(bad)


def test_no_package_cycles():
    edges: dict[str, set] = {}
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        src = ".".join(mod.split(".")[:2])
        for target, _ in imports(path):
            dst = ".".join(target.split(".")[:2])
            if dst != src:
                edges.setdefault(src, set()).add(dst)
    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a in edges.get(b, ()) and a < b)
    assert not cycles, cycles


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk resolves relative and function-local imports (so the tests above can fail)."""
    f = PKG / "kernels" / "registry.py"
    found = imports(f)
    assert any(t == "ortmlx.ir" for t, _ in found), found
    code = "def f():\n    from ..ep import options\n"
    p = PKG / "kernels" / "_probe_layers.py"
    try:
        p.write_text(code)
        assert [(t, layer(t)) for t, _ in imports(p)] == [("ortmlx.ep.options", 5)]
    finally:
        p.unlink()

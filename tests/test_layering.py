"""Layering: calibration imports neither evaluation nor the commands (no package-level import loop), and the
teacher-forced comparison (kascade.fidelity) sits below both. Every import counts, those inside functions too."""

import ast
from pathlib import Path

import kascade

SRC = Path(kascade.__file__).parent


def _imports(path: Path) -> set[str]:
    """The kascade modules a file imports, as dotted names (relative imports resolved)."""
    parts = ["kascade", *path.relative_to(SRC).with_suffix("").parts]
    package = parts[:-1]  # a module's package; an __init__'s own package
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
                out |= {".".join(base + ([a.name] if not node.module else [])) for a in node.names}
            else:
                out.add(node.module)
    return {m for m in out if m.split(".")[0] == "kascade"}


def _parts(path: Path) -> set[str]:
    """The second component of every kascade module imported: the subpackage or top-level module."""
    return {m.split(".")[1] for m in _imports(path) if "." in m}


def test_calibration_imports_no_evaluation_and_no_command():
    for path in sorted((SRC / "calibrate").rglob("*.py")):
        assert not _parts(path) & {"eval", "demo", "cli", "bench"}, (path.name, _imports(path))


def test_fidelity_sits_below_calibration_and_evaluation():
    assert _imports(SRC / "fidelity.py") == {"kascade.integration.hf"}
    assert "fidelity" in _parts(SRC / "calibrate" / "search.py") | _parts(SRC / "calibrate" / "pipeline.py")
    assert "fidelity" in _parts(SRC / "eval" / "runner.py") and "fidelity" in _parts(SRC / "demo.py")


def test_no_import_loop_between_subpackages():
    """Between the package's parts (subpackages and top-level modules), imports form no cycle."""
    graph: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        part = rel.parts[0].removesuffix(".py")
        if part == "__init__":
            continue  # the package's front door re-exports everything
        graph.setdefault(part, set()).update(p for p in _parts(path) if p != part)
    seen, stack = set(), []

    def visit(node):
        if node in stack:
            raise AssertionError("import loop: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in seen:
            return
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in sorted(graph):
        visit(node)
    assert {"ops", "integration", "calibrate", "eval", "bench"} <= set(graph)

"""The package's layers (ARCHITECTURE.md): every import points down the list, no module imports itself back, and no
module is too long to read.

Every import counts: module level, inside functions and under ``TYPE_CHECKING``. The list, bottom to top:

0. ``grpo_cli.errors``, ``grpo_cli._format``, ``grpo_cli._choices``, ``grpo_cli._constants``, ``grpo_cli._launch``,
   ``grpo_cli._keys`` — exceptions, exit codes, number formatting, the command line's choices, the constants several
   layers share, the launcher's environment, the generated key and option lists (all torch-free);
1. ``grpo_cli.core`` — pure torch;
2. ``grpo_cli.io`` — Parquet in and out;
3. ``grpo_cli.engine`` — the streaming run;
4. ``grpo_cli.metrics``, ``grpo_cli.findings`` — the metric groups and their declared figures; the detectors that
   turn figures into findings;
5. ``grpo_cli.commands``, ``grpo_cli.integrations`` — commands (results, no printing), trainer hooks;
6. ``grpo_cli.render`` — every output;
7. ``grpo_cli.cli``, ``grpo_cli.__main__`` — the command line.

A module may import its own layer and those below; the package root (lazy re-exports) is exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_cli"

LAYERS = {
    "grpo_cli.errors": 0,
    "grpo_cli._format": 0,
    "grpo_cli._choices": 0,
    "grpo_cli._constants": 0,
    "grpo_cli._launch": 0,
    "grpo_cli._keys": 0,
    "grpo_cli._intervals": 0,
    "grpo_cli.core": 1,
    "grpo_cli.io": 2,
    "grpo_cli.engine": 3,
    "grpo_cli.metrics": 4,
    "grpo_cli.findings": 4,
    "grpo_cli.commands": 5,
    "grpo_cli.integrations": 5,
    "grpo_cli.render": 6,
    "grpo_cli.cli": 7,
    "grpo_cli.__main__": 7,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if path.name == "__init__.py" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (a ``from pkg import sub`` names the submodule)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in modules:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                found.add(target)
    return found


def _layer(module: str) -> int | None:
    for prefix, layer in sorted(LAYERS.items(), key=lambda item: -len(item[0])):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def test_every_module_has_a_layer():
    unplaced = [m for m in _modules() if m != "grpo_cli" and _layer(m) is None]
    assert unplaced == []


def test_imports_point_down():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if name == "grpo_cli":
            continue
        for target in _imports(name, path, modules):
            if target == "grpo_cli":
                continue  # the root only re-exports lazily (and holds __version__)
            if _layer(target) > _layer(name):  # type: ignore[operator]
                upward.append(f"{name} -> {target}")
    assert sorted(upward) == []


def test_no_import_cycles():
    modules = _modules()
    edges = {name: {t for t in _imports(name, path, modules) if t != "grpo_cli"} for name, path in modules.items()}
    edges.pop("grpo_cli")
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []



MAX_MODULE_LINES = 500
"""A module a maintainer can read in one sitting; a larger one is split along a seam (ARCHITECTURE.md)."""


def test_no_module_is_too_long():
    too_long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert too_long == {}

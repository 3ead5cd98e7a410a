"""The import rule of docs/ARCHITECTURE.md: every module imports only modules of its own layer unit or of lower layers.

An AST walk over rollout_hpc/ (top-level imports, imports inside functions and under TYPE_CHECKING alike: an
in-function import is still a dependency). A new top-level module or package has to be given a layer here and
in docs/ARCHITECTURE.md before this test passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rollout_hpc"

# Bottom first. A unit (a top-level module or package of rollout_hpc) may import units of lower layers and
# itself, nothing above. Units on one line form one layer and must not import each other.
LAYERS: list[tuple[str, ...]] = [
    (
        "__init__",
        "errors",
        "trajectory",
        "rundir_layout",
        "_ring",
        "worker_process",
        "process_exit",
    ),  # contracts every layer shares; import nothing of ours
    ("algos",),  # the algorithm table (the config reads its names) and pure torch functions; imports nothing of ours
    ("config",),
    ("plugins", "scale"),
    ("rewards",),
    ("envs",),
    ("store",),
    ("models",),
    ("exchange",),
    ("backends",),
    ("runtime",),
    ("analysis",),
    ("launch",),
    ("commands",),
    ("cli",),
    ("__main__",),
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _units() -> set[str]:
    found = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    found |= {p.name.split(".")[0] for p in PACKAGE.glob("_ring*.so")}
    return found


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def unit_of(module: str) -> str | None:
    """'rollout_hpc.store.trajlog' -> 'store'; 'rollout_hpc' -> '__init__'; None for other packages."""
    parts = module.split(".")
    if parts[0] != "rollout_hpc":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, wherever it sits; `from rollout_hpc import x`
    names rollout_hpc.x when x is one of our units."""
    found = []
    units = _units()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "rollout_hpc":
                found += [(node.lineno, f"rollout_hpc.{a.name}" if a.name in units else target) for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def violations(source: str, module: str, is_package: bool = False, where: str = "<source>") -> list[str]:
    own = unit_of(module)
    bad = []
    for line, target in imported_modules(source, module, is_package):
        unit = unit_of(target)
        if unit is None or unit == own:
            continue
        if unit not in RANK:
            bad.append(f"{where}:{line}: imports {target}, whose unit '{unit}' has no layer in tests/test_layers.py")
        elif RANK[unit] >= RANK[own]:
            bad.append(
                f"{where}:{line}: {own} (layer {RANK[own]}) imports {target} ({unit}, layer {RANK[unit]}): "
                "upper layers import lower ones only (docs/ARCHITECTURE.md)"
            )
    return bad


def test_every_unit_has_a_layer():
    missing = sorted(_units() - set(RANK))
    assert not missing, f"give these modules a layer in tests/test_layers.py and docs/ARCHITECTURE.md: {missing}"


def test_imports_point_down():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module, is_package = _module_name(path)
        bad += violations(path.read_text(), module, is_package, str(path.relative_to(PACKAGE.parent)))
    assert not bad, "\n".join(bad)


def test_architecture_doc_states_the_same_order():
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    order = [
        line.split("`")[1]
        for line in doc.splitlines()
        if line.startswith("| ") and line.count("`") >= 2 and line.split("|")[1].strip().isdigit()
    ]
    assert order == [" ".join(units) for units in LAYERS], "docs/ARCHITECTURE.md's layer table differs from LAYERS"


@pytest.mark.parametrize(
    "source, module, expect",
    [
        ("from rollout_hpc.exchange.forward import Exchange", "rollout_hpc.store.trajlog", 1),  # up
        (
            "def f():\n    from rollout_hpc.launch import rundir",
            "rollout_hpc.runtime.checkpointing",
            1,
        ),  # up, in a function
        ("from rollout_hpc import commands", "rollout_hpc.launch.resume", 1),  # up, through the package
        ("from ..store import trajlog", "rollout_hpc.exchange.forward", 0),  # relative, down
        ("from . import atomic", "rollout_hpc.store.checkpoint", 0),  # same unit
        ("from rollout_hpc import __version__", "rollout_hpc.launch.render", 0),  # the package root is the bottom
        ("from rollout_hpc.runtime import train_program", "rollout_hpc.analysis.summary", 0),  # down
        ("import numpy, rollout_hpc.cli", "rollout_hpc.config", 1),  # plain import, up
    ],
)
def test_the_checker_itself(source, module, expect):
    assert len(violations(source, module)) == expect, violations(source, module)

"""rollout_hpc/_ring.pyi matches the extension it types: the same names, members, parameters,
exception hierarchy. (Types themselves are the type checker's business.)"""

from __future__ import annotations

import ast
import builtins
import inspect
import pickle
import sys
from pathlib import Path

import pytest

import rollout_hpc
from rollout_hpc import _ring

STUB = Path(rollout_hpc.__file__).with_name("_ring.pyi")
# The buffer protocol's Python-level names exist from Python 3.12 on (PEP 688); before, the
# slots are there but unnamed, so they are checked by use (test_buffer_protocol).
BUFFER_DUNDERS = {"__buffer__", "__release_buffer__"}


def _public(name: str) -> bool:
    return not name.startswith("_") or name == "__version__"


def _stub() -> dict[str, ast.stmt]:
    tree = ast.parse(STUB.read_text())
    names: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def _members(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def test_module_names_match_stub():
    stub = {name for name in _stub() if _public(name)}
    runtime = {name for name in dir(_ring) if _public(name)}
    assert stub == runtime, f"only in the stub: {stub - runtime}; only in the module: {runtime - stub}"
    (stub_all,) = [
        ast.literal_eval(n.value)
        for n in ast.parse(STUB.read_text()).body
        if isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"]
    ]
    assert sorted(stub_all) == sorted(_ring.__all__)


@pytest.mark.parametrize("name", ["Ring", "RecordView", "RecordWriter"])
def test_class_members_match_stub(name):
    stub_cls = _stub()[name]
    assert isinstance(stub_cls, ast.ClassDef)
    members = _members(stub_cls)
    runtime_cls = getattr(_ring, name)
    stub_public = {m for m in members if not m.startswith("_")}
    runtime_public = {m for m in dir(runtime_cls) if not m.startswith("_")}
    assert stub_public == runtime_public, (
        f"{name}: only in the stub: {stub_public - runtime_public}; only in the module: {runtime_public - stub_public}"
    )
    for m, node in members.items():
        if m.startswith("__") and (m in BUFFER_DUNDERS and sys.version_info < (3, 12)):
            continue
        assert hasattr(runtime_cls, m), f"{name}.{m} is in the stub but not in the module"
        attr = inspect.getattr_static(runtime_cls, m)
        decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
        if "property" in decorators:
            assert inspect.isdatadescriptor(attr), f"{name}.{m}: the stub says property"
            continue
        assert isinstance(attr, staticmethod) == ("staticmethod" in decorators), f"{name}.{m}: staticmethod or not"
        if m.startswith("__"):
            continue
        stub_params = [a.arg for a in node.args.args + node.args.kwonlyargs]
        stub_params = [p for p in stub_params if p != "self"]
        runtime_params = [p for p in inspect.signature(getattr(runtime_cls, m)).parameters if p != "self"]
        assert stub_params == runtime_params, f"{name}.{m}: stub {stub_params} vs module {runtime_params}"
        stub_defaults = len(node.args.defaults)
        runtime_defaults = sum(
            p.default is not inspect.Parameter.empty
            for p in inspect.signature(getattr(runtime_cls, m)).parameters.values()
        )
        assert stub_defaults == runtime_defaults, f"{name}.{m}: optional parameters differ"


def test_exception_hierarchy_matches_stub_and_pickles():
    stub = _stub()
    for name in ["RingError", "RingTimeout", "RingClosed", "RecordTooLarge"]:
        node = stub[name]
        assert isinstance(node, ast.ClassDef)
        (base,) = [b.id for b in node.bases if isinstance(b, ast.Name)]
        cls = getattr(_ring, name)
        assert cls.__bases__ == (getattr(_ring, base) if hasattr(_ring, base) else getattr(builtins, base),)
        assert (cls.__module__, cls.__name__) == ("rollout_hpc._ring", name)
        err = pickle.loads(pickle.dumps(cls("ring /x: message")))  # crosses process boundaries
        assert type(err) is cls and str(err) == "ring /x: message"


def test_stats_keys_match_stub(tmp_path):
    stub_stats = _stub()["_Stats"]
    assert isinstance(stub_stats, ast.ClassDef)
    keys = [n.target.id for n in stub_stats.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    ring = _ring.Ring.create(str(tmp_path / "r"), 4096)
    stats = ring.stats()
    assert list(stats) == keys
    types = {n.target.id: n.annotation.id for n in stub_stats.body if isinstance(n, ast.AnnAssign)}
    assert {k: type(v).__name__ for k, v in stats.items()} == types


def test_buffer_protocol(tmp_path):
    ring = _ring.Ring.create(str(tmp_path / "r"), 4096)
    writer = ring.reserve(3)
    with memoryview(writer) as m:
        assert not m.readonly
        m[:] = b"abc"
    writer.commit()
    view = ring.pop_view()
    with memoryview(view) as m:
        assert m.readonly and bytes(m) == b"abc" and len(view) == 3
    view.ack()

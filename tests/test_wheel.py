"""The built wheel works without the checkout and without Rust: it installs into a fresh venv and renders a job.
And the declared dependencies (pyproject.toml) match what the package and tools/ import.

Builds the wheel with maturin (the one step that needs cargo), installs it with `pip --no-deps` into a new venv
whose other packages come from this test's environment (a path entry, so the checkout's editable install is not
seen), then runs `rollout-hpc render configs/smoke.yaml --set launcher=slurm` from a directory outside the
checkout, on a PATH without cargo: the job script templates must come from inside the installed package; and
`rollout-hpc init --example quickstart` + `validate` in an empty directory: the examples and their data too.
ROLLOUT_TEST_WHEEL=PATH tests a wheel built elsewhere instead of building one.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
# Modules whose distribution is named otherwise and is not installed here (GPU-only packages).
NOT_INSTALLED_HERE = {"megatron": "megatron-core", "vllm": "vllm"}
# Packages the code uses through another one's module (torch.utils.tensorboard needs tensorboard).
IMPORTED_THROUGH = {"torch.utils.tensorboard": "tensorboard"}
# Extras for the package's own optional features; bench and test serve tools/ and tests/ only.
PACKAGE_EXTRAS_EXCLUDED = {"bench", "test"}


def _maturin() -> str | None:
    return shutil.which("maturin", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def _cargo_path() -> str:
    cargo_bin = Path.home() / ".cargo" / "bin"
    return os.pathsep.join(p for p in [str(cargo_bin), os.environ.get("PATH", "")] if p)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    prebuilt = os.environ.get("ROLLOUT_TEST_WHEEL")  # test a wheel built elsewhere (e.g. in the manylinux container)
    if prebuilt:
        return Path(prebuilt)
    maturin = _maturin()
    if maturin is None or shutil.which("cargo", path=_cargo_path()) is None:
        pytest.skip("building the wheel needs maturin and cargo")
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "PATH": _cargo_path()}
    env.pop("VIRTUAL_ENV", None)  # maturin build would otherwise pick the venv's interpreter anyway; be explicit
    done = subprocess.run(
        [maturin, "build", "--release", "-i", sys.executable, "-o", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels = list(out.glob("rollout_hpc-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.slow
def test_wheel_ships_the_templates(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in ("rollout.sbatch", "directives.j2"):
        shipped = f"rollout_hpc/slurm_templates/{template}"
        assert shipped in names, sorted(n for n in names if not n.endswith(".py"))
        assert zipfile.ZipFile(wheel).read(shipped) == (REPO / "slurm" / template).read_bytes()
    assert any(n.startswith("rollout_hpc/_ring") and n.endswith(".so") for n in names)
    # the examples and their data, for `rollout-hpc init` (every file of configs/, byte for byte)
    configs = [p for p in (REPO / "configs").rglob("*") if p.is_file()]
    assert any(p.suffix == ".jsonl" for p in configs)
    for path in configs:
        shipped = f"rollout_hpc/example_configs/{path.relative_to(REPO / 'configs').as_posix()}"
        assert shipped in names, shipped
        assert zipfile.ZipFile(wheel).read(shipped) == path.read_bytes()


@pytest.mark.slow
def test_installed_wheel_renders_and_inits_outside_the_checkout_without_cargo(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # The dependencies (numpy, pydantic, jinja2, ...) from this environment, as a plain path entry: .pth files
    # there (the checkout's editable install) are not processed, and the venv's own site-packages come first.
    (site / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    work = tmp_path / "elsewhere"
    (work / "configs").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "smoke.yaml", work / "configs" / "smoke.yaml")
    path = os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    assert shutil.which("cargo", path=path) is None
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "ROLLOUT_TEMPLATES", "VIRTUAL_ENV", "CARGO_HOME", "RUSTUP_HOME")
    }
    env.update(PATH=path, HOME=str(tmp_path))

    where = subprocess.run(
        [str(py), "-c", "import rollout_hpc._ring, rollout_hpc; print(rollout_hpc.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr[-3000:]
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel's copy, not the checkout

    done = subprocess.run(
        [str(venv / "bin" / "rollout-hpc"), "render", "configs/smoke.yaml", "--set", "launcher=slurm"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "#SBATCH hetjob" in done.stdout
    assert "python -m rollout_hpc.runtime.entry" in done.stdout or "rollout_hpc.runtime.entry" in done.stdout

    # A new user with no checkout: `init` writes the quickstart and its data from the package, and it validates.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for argv in (["init", "--example", "quickstart"], ["validate", "quickstart.yaml"]):
        done = subprocess.run(
            [str(venv / "bin" / "rollout-hpc"), *argv], cwd=fresh, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (fresh / "quickstart.yaml").read_bytes() == (REPO / "configs" / "quickstart.yaml").read_bytes()
    assert "1800 training prompts" in done.stdout


# --- declared dependencies ------------------------------------------------------------------------------------------


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    """{"core" or extra name: {normalised distribution names}} from pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project.get("optional-dependencies", {})}
    return {group: {_normal(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in reqs} for group, reqs in groups.items()}


def _third_party_imports(root: Path) -> dict[str, set[str]]:
    """{top-level module: {files importing it}} for every import under `root` (in functions too) that is neither
    the standard library nor ours."""
    # ours: the package, the modules beside the file, and the test suite's helpers (tools/chaos.py reuses them)
    local = {p.stem for p in root.glob("*.py")} | {p.stem for p in (REPO / "tests").glob("*.py")} | {"rollout_hpc"}
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            tops = {n.split(".")[0] for n in names} | {IMPORTED_THROUGH[n] for n in names if n in IMPORTED_THROUGH}
            for top in tops - set(sys.stdlib_module_names) - local:
                found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def _distributions(module: str) -> set[str]:
    """The normalised names a module's distribution may be declared under."""
    installed = importlib.metadata.packages_distributions().get(module, [])
    return {_normal(d) for d in installed} | {_normal(NOT_INSTALLED_HERE.get(module, module))}


def test_every_import_of_the_package_is_declared_and_every_declared_package_imported():
    declared = _declared()
    anywhere = set().union(*declared.values())
    imports = _third_party_imports(REPO / "rollout_hpc")
    undeclared = {m: sorted(f) for m, f in imports.items() if not _distributions(m) & anywhere}
    assert not undeclared, f"imported but not in pyproject.toml (dependencies or an extra): {undeclared}"
    used = set().union(*(_distributions(m) for m in imports))
    for group, names in declared.items():
        if group not in PACKAGE_EXTRAS_EXCLUDED:
            assert names <= used, (
                f"pyproject.toml [{group}] declares {sorted(names - used)}, which rollout_hpc never imports"
            )
    bench_in_package = {m for m in imports if _distributions(m) & declared["bench"]} - {
        m for m in imports if _distributions(m) & (anywhere - declared["bench"])
    }
    assert not bench_in_package, f"the package imports bench-only packages {sorted(bench_in_package)}"


def test_tools_import_only_declared_packages():
    anywhere = set().union(*_declared().values())
    imports = _third_party_imports(REPO / "tools")
    undeclared = {m: sorted(f) for m, f in imports.items() if not _distributions(m) & anywhere}
    assert not undeclared, (
        f"tools/ imports packages pyproject.toml does not declare (add them to the bench extra): {undeclared}"
    )


def test_what_the_cli_imports_at_start_is_a_core_dependency():
    # `rollout-hpc --help` imports every command: what it loads of the package's direct imports must come with a
    # plain `pip install rollout-hpc`, and none of the heavy ones may be among them (the CLI must start fast).
    probe = "import sys, rollout_hpc.cli as c; c.build_parser(); print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    started = {m.split(".")[0] for m in loaded.stdout.split()}
    direct = set(_third_party_imports(REPO / "rollout_hpc"))
    core = _declared()["core"]
    not_core = sorted(m for m in started & direct if not _distributions(m) & core)
    assert not not_core, f"the CLI imports {not_core} at start, which are not in pyproject.toml [project] dependencies"
    heavy = sorted(started & {"torch", "transformers", "h5py", "matplotlib", "deepspeed", "vllm"})
    assert not heavy, f"`rollout-hpc --help` imports {heavy}: import them inside the command that needs them"

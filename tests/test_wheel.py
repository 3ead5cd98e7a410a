"""The built wheel works without the checkout and without Rust: it installs into a fresh venv and renders a job.

Builds the wheel with maturin (the one step that needs cargo), installs it with `pip --no-deps` into a new venv
whose other packages come from this test's environment (a path entry, so the checkout's editable install is not
seen), then runs `rollout-hpc render configs/smoke.yaml --set launcher=slurm` from a directory outside the
checkout, on a PATH without cargo: the job script templates must come from inside the installed package.
ROLLOUT_TEST_WHEEL=PATH tests a wheel built elsewhere instead of building one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


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


def test_wheel_ships_the_templates(wheel):
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for template in ("rollout.sbatch", "directives.j2"):
        shipped = f"rollout_hpc/slurm_templates/{template}"
        assert shipped in names, sorted(n for n in names if not n.endswith(".py"))
        assert zipfile.ZipFile(wheel).read(shipped) == (REPO / "slurm" / template).read_bytes()
    assert any(n.startswith("rollout_hpc/_ring") and n.endswith(".so") for n in names)


def test_installed_wheel_renders_outside_the_checkout_without_cargo(wheel, tmp_path):
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

"""rollout-hpc init [--example NAME] [--out FILE]: write a commented starter config (and the data files it names).

The examples are the checkout's configs/ (configs/*.yaml, configs/examples/*.yaml), shipped inside the package as
rollout_hpc/example_configs (a link to ../configs in a checkout, a copy in the wheel: pyproject.toml), so `init`
works from a pip install with no checkout. A config's dataset paths are relative to where you submit; the data files
it names are copied beside FILE under the same relative paths, so `cd DIR && rollout-hpc submit FILE` runs as is.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from importlib import resources
from pathlib import Path

from rollout_hpc.commands import err, out
from rollout_hpc.errors import UserError

PACKAGED_EXAMPLES = "example_configs"  # package data (pyproject.toml [tool.maturin] include)
DEFAULT_EXAMPLE = "quickstart"
# A data file an example names, written as the path relative to the directory the run is submitted from.
DATA_REFERENCE = re.compile(r"\bconfigs/[\w./-]+\.(?:jsonl|json|parquet|csv)\b")


def examples_dir() -> Path:
    """The shipped examples: rollout_hpc/example_configs, else configs/ of the checkout this module is in."""
    shipped = Path(str(resources.files("rollout_hpc") / PACKAGED_EXAMPLES))
    if (shipped / f"{DEFAULT_EXAMPLE}.yaml").is_file():
        return shipped
    return Path(__file__).resolve().parents[2] / "configs"


def examples() -> dict[str, Path]:
    """Example name (the file's stem) -> its file: configs/*.yaml, then configs/examples/*.yaml."""
    root = examples_dir()
    found = {p.stem: p for p in sorted(root.glob("examples/*.yaml"))}
    found.update({p.stem: p for p in sorted(root.glob("*.yaml"))})
    return dict(sorted(found.items()))


def first_comment_line(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def data_files(text: str) -> list[str]:
    """The shipped data files a config's text names (in its keys or in its comments' --set lines), as written."""
    names = dict.fromkeys(m.group(0) for m in DATA_REFERENCE.finditer(text))
    return [name for name in names if shipped_path(name).is_file()]


def shipped_path(name: str) -> Path:
    """configs/data/x.jsonl -> that file among the shipped examples."""
    return examples_dir() / Path(name).relative_to("configs")


def cmd_init(args: argparse.Namespace) -> int:
    available = examples()
    if args.list:
        for name, path in available.items():
            out.print(f"{name:26s} {first_comment_line(path)}", markup=False, highlight=False)
        return 0
    if args.example not in available:
        raise UserError(
            f"--example {args.example}: no such example; the examples are {', '.join(available)} "
            "(`rollout-hpc init --list` describes each)"
        )
    source = available[args.example]
    text = source.read_text()
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    target = Path(args.out or f"{args.example}.yaml")
    base = target.parent
    copies = [(shipped_path(name), base / name) for name in data_files(text)]
    clashes = [
        str(dst) for src, dst in [(source, target), *copies] if dst.exists() and dst.read_bytes() != src.read_bytes()
    ]
    if clashes and not args.force:
        raise UserError(f"{', '.join(clashes)} already exist(s) with other content; pass --force to overwrite")
    base.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    for src, dst in copies:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    err.print(f"wrote {target} (example {args.example})" + "".join(f"\n  data: {dst}" for _, dst in copies))
    where = "" if base.resolve() == Path.cwd().resolve() else f"cd {base} && "
    err.print(f"next: {where}rollout-hpc validate {target.name}   then   {where}rollout-hpc submit {target.name}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "init",
        help="write a commented starter config (an example, with the data files it uses)",
        description="Writes one of the shipped example configs, comments included, to FILE (default ./NAME.yaml), "
        "and the data files it names under their relative paths beside it (dataset paths are relative to where "
        "you submit). Edit it, then `rollout-hpc validate FILE` and `rollout-hpc submit FILE`.",
    )
    p.add_argument(
        "--example",
        default=DEFAULT_EXAMPLE,
        metavar="NAME",
        help=f"which example (default {DEFAULT_EXAMPLE}; --list shows them)",
    )
    p.add_argument("--out", metavar="FILE", help="where to write it (default ./NAME.yaml; - for stdout)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.add_argument("--list", action="store_true", help="list the examples with their first comment line")
    p.set_defaults(func=cmd_init)

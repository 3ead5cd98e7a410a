"""rollout-hpc schema: every config key with its type, default and meaning (and, for the algorithm section, the
algorithms of rollout_hpc/algos/table.py)."""

from __future__ import annotations

import argparse
import json
import typing

import yaml
from pydantic import BaseModel
from rich.table import Table

from rollout_hpc.algos.table import ALGORITHMS
from rollout_hpc.commands import out
from rollout_hpc.config import Config, json_schema
from rollout_hpc.errors import UserError


def _type_name(annotation: typing.Any) -> str:
    text = str(annotation).replace("typing.", "")
    return text.replace("<class '", "").replace("'>", "")


def _rows(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        inner = info.annotation
        # A nested section (or an optional one, like slurm.container) lists its own keys.
        candidates = [inner, *typing.get_args(inner)]
        section = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if section is not None:
            yield from _rows(section, path + ".")
            continue
        default = "(required)" if info.is_required() else json.dumps(info.get_default(call_default_factory=True))
        yield path, _type_name(inner), default, info.description or ""


def _algorithm_rows():
    """The values of algorithm.name: one row of rollout_hpc/algos/table.py each."""
    for a in ALGORITHMS.values():
        yield (
            a.name,
            a.advantage,
            "yes" if a.needs_critic else "no",
            a.kl_in,
            str(a.min_group_size),
            "on" if a.dynamic_sampling else "off",
            a.paper_agg,
            a.summary,
        )


ALGORITHM_COLUMNS = ("algorithm.name", "advantage", "critic", "KL in", "min group", "dynamic sampling", "paper agg", "")


def run(args: argparse.Namespace) -> int:
    if args.format == "json":
        print(json.dumps(json_schema(), indent=2))
        return 0
    if args.format == "defaults":
        print(yaml.safe_dump(Config().resolved(), sort_keys=False), end="")
        return 0
    rows = [r for r in _rows(Config) if not args.section or r[0].split(".")[0] == args.section]
    if not rows:
        sections = ", ".join(Config.model_fields)
        raise UserError(f"no config section '{args.section}'; the sections are {sections}")
    algorithms = list(_algorithm_rows()) if args.section == "algorithm" else []
    if not out.is_terminal:  # piped: one key per line, whole, for grep
        for key, kind, default, meaning in rows:
            print(f"{key}: {kind} = {default}" + (f"  # {meaning}" if meaning else ""))
        for name, *fields, summary in algorithms:
            details = ", ".join(f"{column} {value}" for column, value in zip(ALGORITHM_COLUMNS[1:-1], fields))
            print(f"algorithm.name {name}: {summary} ({details})")
        return 0
    table = Table(title="rollout-hpc config keys" + (f" ({args.section})" if args.section else ""))
    for column in ("key", "type", "default", "meaning"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    out.print(table)
    if algorithms:
        table = Table(title="the algorithms (rows of rollout_hpc/algos/table.py)")
        for column in ALGORITHM_COLUMNS:
            table.add_column(column, overflow="fold")
        for algorithm in algorithms:
            table.add_row(*algorithm)
        out.print(table)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "schema",
        help="list the config keys (types, defaults, meaning)",
        description="List every config key with its type, default and meaning, or print the JSON schema "
        "(for editors) or a complete config of defaults (a starting point).",
        epilog="examples:\n  rollout-hpc schema\n  rollout-hpc schema slurm\n"
        "  rollout-hpc schema --format json > rollout-hpc.schema.json\n"
        "  rollout-hpc schema --format defaults > my-run.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("section", nargs="?", help="only this section (run, model, algorithm, slurm, ...)")
    p.add_argument(
        "--format",
        choices=("table", "json", "defaults"),
        default="table",
        help="table (default), json (JSON schema) or defaults (YAML of all defaults)",
    )
    p.set_defaults(func=run)

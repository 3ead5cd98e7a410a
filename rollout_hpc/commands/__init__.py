"""CLI subcommands: one module per command group, each with `register(subparsers)`.

cli.py imports every module here (pkgutil), so a new command is a new file. A command's handler
is set with `parser.set_defaults(func=handler)`; handler(args) -> exit code. Raise
rollout_hpc.errors.UserError for anything the user can fix: the CLI prints it as one paragraph.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from rollout_hpc.config import Config, load_config

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def add_config_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """CONFIG positional and the repeatable --set KEY.PATH=VALUE."""
    parser.add_argument(
        "config",
        metavar="CONFIG",
        nargs=None if required else "?",
        help="YAML run config, e.g. configs/quickstart.yaml",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config value (repeatable); VALUE is YAML: --set algorithm.steps=5 --set slurm.modules=[cuda/12]",
    )


def load(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def config_path(args: argparse.Namespace) -> Path | None:
    return Path(args.config) if args.config else None

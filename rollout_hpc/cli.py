"""rollout-hpc: the command line. Subcommands live in rollout_hpc/commands/, one module each.

Exit codes: 0 success; 2 a problem the user can fix (bad config, refused submission, bad
arguments), printed as one paragraph without a traceback; 130 interrupted; otherwise the run's
own exit code (local runs) or 1 for an internal error (with its traceback: that is a bug).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import traceback

from rollout_hpc import __version__, commands
from rollout_hpc.errors import UserError
from rollout_hpc.process_exit import exit_now

EPILOG = """\
examples:
  rollout-hpc validate configs/quickstart.yaml          check a config, show the job it describes
  rollout-hpc submit configs/quickstart.yaml            run the CPU quickstart (local mpirun)
  rollout-hpc render configs/hello.yaml        print the sbatch script for a config
  rollout-hpc submit my.yaml --set trainer.nodes=4      submit to Slurm with one value changed
  rollout-hpc status runs/my-run                        state of each het component of the run's jobs
  rollout-hpc cancel runs/my-run                        cancel every job of the run
  rollout-hpc schema slurm                              the keys of the slurm section

Every command that takes a CONFIG also takes --set KEY.PATH=VALUE (repeatable; VALUE is YAML).
Add --debug anywhere to see the full traceback of an error.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-hpc",
        description="Slurm-native RL training of LLMs: one YAML config becomes one heterogeneous Slurm job "
        "(generator nodes + trainer nodes, one MPI world), or the same layout under mpirun on one machine.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rollout-hpc {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{module.name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug works before or after the subcommand.
    debug = "--debug" in argv or os.environ.get("ROLLOUT_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        print(f"rollout-hpc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # files and directories the user named: unreadable, unwritable, missing
        if debug:
            traceback.print_exc()
        print(f"rollout-hpc {args.command}: error: {exc} (run with --debug for details)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rollout-hpc: interrupted", file=sys.stderr)
        return 130


def console_main() -> int:
    """The `rollout-hpc` command: main(), then the process ends without the interpreter's tear-down (1.5 s once a
    command has loaded torch; rollout_hpc.process_exit). Tests call main() and keep their process."""
    code = main()
    exit_now(code)
    return code


if __name__ == "__main__":
    raise SystemExit(console_main())

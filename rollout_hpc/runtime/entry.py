"""The program every rank of a run executes: `python -m rollout_hpc.runtime.entry --run-dir RUN_DIR`.

It reads RUN_DIR/config.resolved.yaml (written by the launcher), joins the MPI
world and runs `run.program`: "hello" proves the world and exits; "train" runs
the RL loop (`rollout_hpc.runtime.train_program.main(world, cfg, run_dir)`).

Errors a user can fix (config, launch shape, a data layout mismatch) are
printed once, without a traceback, and every rank stops: one failed rank must
never leave the others blocked in MPI until the time limit.
"""

from __future__ import annotations

from rollout_hpc.runtime import early_signals

early_signals.hold()  # before the imports below: a time-limit warning during start-up must not kill the rank

import argparse
import faulthandler
import io
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import cast

from rollout_hpc.config import load_config
from rollout_hpc.errors import EntryError, UserError
from rollout_hpc.exchange.forward import ExchangeError
from rollout_hpc.process_exit import exit_now
from rollout_hpc.rundir_layout import EXIT_USER_ERROR, RESOLVED_CONFIG
from rollout_hpc.runtime import heap, startup_gc
from rollout_hpc.runtime.world import WorldError, init_world
from rollout_hpc.trajectory import LayoutError


def _launch_rank() -> int:
    """World rank from the launcher's environment, before MPI is initialised."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _load_program(name: str):
    if name == "hello":
        from rollout_hpc.runtime import hello  # in here: a program's imports load only when it runs

        return hello.main
    if name == "profile":
        from rollout_hpc.runtime import profile_program

        return profile_program.main
    try:
        from rollout_hpc.runtime import train_program  # in here: torch, transformers; "hello" must not need them
    except ModuleNotFoundError as exc:
        if exc.name != "rollout_hpc.runtime.train_program":
            raise
        raise EntryError(
            "run.program 'train' needs rollout_hpc.runtime.train_program, which this install lacks; "
            "update rollout-hpc, or set run.program: hello to only check the MPI world"
        ) from None
    return train_program.main


def run(run_dir: Path) -> int:
    cfg_path = run_dir / RESOLVED_CONFIG
    if not cfg_path.is_file():
        raise EntryError(
            f"{cfg_path} not found; the run directory is made by `rollout-hpc submit` (or the local launcher), "
            "pass --run-dir of such a directory"
        )
    cfg = load_config(cfg_path)
    if cfg.run.program not in ("hello", "profile"):  # train_program releases it once the rank is built
        startup_gc.hold()
    heap.keep_freed_memory()  # a step's freed tensors stay for the next step, not page-faulted back (runtime/heap.py)
    program = _load_program(cfg.run.program)
    # MPI start-up waits for every rank in C, holding the GIL: a peer that never starts (a het step Slurm could not
    # launch on one node) would hold this rank until the time limit, with no Python thread able to say so.
    # faulthandler's own timer needs no GIL: past run.hang_timeout it prints "Timeout" and where (init_world), and
    # exits 1, which ends the job step.
    if cfg.run.hang_timeout > 0:
        faulthandler.dump_traceback_later(cfg.run.hang_timeout, exit=True, file=sys.stderr)
    try:
        world = init_world(cfg)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return program(world, cfg, run_dir) or 0


def _mpi_up() -> bool:
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI

    return MPI.Is_initialized() and not MPI.Is_finalized()


def _abort(code: int) -> None:
    """Stop every rank of the world if MPI is up (a lone exit would leave the others blocked)."""
    if _mpi_up():
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_hpc.runtime.entry", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory holding config.resolved.yaml")
    args = parser.parse_args(argv)
    # One write per line, whatever PYTHONUNBUFFERED says: unbuffered text I/O writes a print's text and its
    # newline separately, and mpirun/srun then splice lines of different ranks together.
    for stream in (sys.stdout, sys.stderr):
        cast(io.TextIOWrapper, stream).reconfigure(line_buffering=True, write_through=False)  # typeshed: a TextIO
    try:
        return run(args.run_dir)
    except (WorldError, EntryError) as exc:
        # The same on every rank (the run directory, the launch shape): say it once.
        if _launch_rank() == 0:
            print(f"rollout-hpc: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (UserError, LayoutError, ExchangeError) as exc:
        if not _mpi_up():
            # Before the world exists (reading the config) every rank sees the same error: say it once.
            if _launch_rank() == 0:
                print(f"rollout-hpc: error: {exc}", file=sys.stderr)
            return EXIT_USER_ERROR
        # Seen by some ranks only (a backend missing on the trainer nodes, a checkpoint from another
        # config, a task plugin the generators cannot import): say it from here and stop the whole
        # world, or the other ranks would wait for this one until the time limit.
        print(f"rollout-hpc: rank {_launch_rank()}: error: {exc}", file=sys.stderr)
        _abort(EXIT_USER_ERROR)
        return EXIT_USER_ERROR
    except BaseException:
        traceback.print_exc()
        _abort(1)
        raise
    finally:
        # From here the rank only tears down. A time-limit warning now must not kill it: when Python
        # finalizes it gives USR1 back its default action (terminate), but leaves an ignored signal ignored.
        for sig in early_signals.STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    code = main()
    exit_now(code)  # a finished rank: skip the interpreter's tear-down
    raise SystemExit(code)

"""Analyse a run without installing the CLI entry point: a thin wrapper over `rollout-hpc analyze` & co.

python tools/analyze.py RUN_DIR [--json]              # = rollout-hpc analyze RUN_DIR
python tools/analyze.py plot|samples|export|compare|report|ckpt ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_hpc.cli import main  # noqa: E402

COMMANDS = {"analyze", "plot", "samples", "export", "compare", "report", "ckpt"}

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] not in COMMANDS | {"-h", "--help"}:
        args = ["analyze", *args]
    raise SystemExit(main(args))

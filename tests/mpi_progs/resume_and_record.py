"""MPI program for tests/test_reshard.py: the real entry point (`rollout_hpc.runtime.entry`), with the
trainer ranks' resume observed: right after `Checkpointer.resume` has loaded the newest checkpoint into
the trainer, the loaded state is saved again, through the same Checkpointer code, into RECORD_DIR (in this
run's layout). The test compares it with the checkpoint that was loaded; then the run goes on as usual.

argv: RUN_DIR RECORD_DIR
"""

import sys
from pathlib import Path

from rollout_hpc.runtime import checkpointing, entry

run_dir, record_dir = Path(sys.argv[1]), Path(sys.argv[2])
load = checkpointing.Checkpointer.resume


def resume_and_record(self, trainer) -> int:
    step = load(self, trainer)
    if step:
        checkpointing.Checkpointer(self.world, self.cfg, record_dir).save(trainer, step)
    return step


checkpointing.Checkpointer.resume = resume_and_record
raise SystemExit(entry.main(["--run-dir", str(run_dir)]))

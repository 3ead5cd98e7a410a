#!/usr/bin/env python3
"""Stress test of heterogeneous MPI job steps on the local test Slurm cluster (tools/slurm_cluster.sh).

Submits N small het jobs (1 generator node + 2 trainer nodes, one task each) whose single step is
`srun --het-group=0,1 --mpi=pmix <program>`, while CPU burners load the machine, and sorts every job into:
  ok            every rank printed its line and the step exited 0
  crashed       the step failed (a rank died: signal or non-zero exit); cores land in OUT/cores-I
  hung          srun was still alive --hang-grace seconds after Slurm stopped listing its step (the job
                killed it); hung+crashed when a rank had also failed
  lost          the job did not finish within --timeout
Programs: mpi4py (a 10-line hello), entry (rollout-hpc's runtime with configs/hello.yaml), fence (whether a
PMIx fence without data waits for the last rank: deterministic, one job tells).

    export SLURM_CONF=/tmp/rollout-slurm-stress/slurm.conf
    tools/stress_slurm_hetjob.py --program entry --jobs 60 --burners 2
    tools/stress_slurm_hetjob.py --program entry --jobs 60 --env SLURM_PMIX_FENCE=tree   # the old setting

Prints one block per failed job (the step's stderr) and, LAST, one JSON line with the counts.
Exit status 1 when any job was not ok.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HELLO = """
import os, sys
from mpi4py import MPI
world = MPI.COMM_WORLD
total = world.allreduce(world.rank)
world.Barrier()
print(f"hello rank={world.rank} size={world.size} node={os.environ['SLURMD_NODENAME']} sum={total}", flush=True)
"""

# Causal check of the PMIx fence without data that ends Open MPI's MPI_Init: the last rank enters it late and
# leaves a marker first; every rank must see the marker after the fence (a no-op fence returns before it exists).
FENCE = """
import ctypes, os, sys, time
from mpi4py import MPI
world = MPI.COMM_WORLD
pmix = ctypes.CDLL("libpmix.so.2")  # the PMIx client library Open MPI already initialised
marker = os.path.abspath("slow-rank-entered-fence")
world.Barrier()
if world.rank == world.size - 1:
    time.sleep(2)
    open(marker, "w").close()
rc = pmix.PMIx_Fence(None, ctypes.c_size_t(0), None, ctypes.c_size_t(0))
waited = os.path.exists(marker)
print(f"hello rank={world.rank} fence_rc={rc} waited_for_last_rank={waited}", flush=True)
world.Barrier()
sys.exit(0 if rc == 0 and waited else 3)
"""

# The job: run the step under a watchdog that tells a hang (srun alive after its step ended) apart.
JOB = r"""#!/bin/bash
#SBATCH --job-name=stress{index}
#SBATCH --nodes=1 --ntasks-per-node=1 --cpus-per-task=1 --time=00:05:00
#SBATCH --output={out}/job-{index}.out
#SBATCH hetjob
#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --time=00:05:00
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONFAULTHANDLER=1
ulimit -c unlimited
{exports}
cd {out}/cores-{index}
srun --het-group=0,1 --mpi=pmix --kill-on-bad-exit=1 {step} > {out}/step-{index}.out 2> {out}/step-{index}.err &
srun_pid=$!
# A hang: srun still there although Slurm has listed no step of this job for {hang_grace}s.
missing=0
while kill -0 $srun_pid 2>/dev/null; do
    sleep 1
    if squeue -h -s -j $SLURM_JOB_ID -o %i | grep -q "^$SLURM_JOB_ID\.[0-9]"; then missing=0; else missing=$((missing + 1)); fi
    if [ "$missing" -ge {hang_grace} ]; then echo HUNG; kill -KILL $srun_pid; break; fi
done
wait $srun_pid
echo "step_rc=$?"
"""


def burn(deadline: float) -> None:
    while time.time() < deadline:
        pass


def sh(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **kw)


def job_listed(job_id: str) -> bool:
    """Whether Slurm still lists the job as pending, running or completing."""
    r = sh("squeue", "-h", "-j", job_id, "-o", "%T")
    return r.returncode == 0 and bool(r.stdout.strip())


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def classify(out: Path, index: int) -> tuple[str, str]:
    """(verdict, evidence) of job number `index` from the files its script wrote."""
    job_out, step_out, step_err = (
        read(out / f"{kind}-{index}.{ext}") for kind, ext in (("job", "out"), ("step", "out"), ("step", "err"))
    )
    ranks = len(re.findall(r"^hello rank=", step_out, re.M | re.I))
    if "HUNG" in job_out:
        return ("hung" if ranks == 3 else "hung+crashed"), step_err
    m = re.search(r"step_rc=(\d+)", job_out)
    if not m:
        return "lost", job_out + step_err
    if m.group(1) == "0" and ranks == 3:
        return "ok", ""
    return "crashed", f"rc={m.group(1)} ranks_printed={ranks}\n{step_err}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument(
        "--parallel", type=int, default=2, help="jobs in flight at once (each takes one CPU on 3 of the 4 nodes)"
    )
    ap.add_argument("--burners", type=int, default=2, help="busy-loop processes loading the CPUs during the run")
    ap.add_argument("--out", type=Path, default=Path("/tmp/stress-hetjob"))
    ap.add_argument("--python", default=str(REPO / ".venv/bin/python"))
    ap.add_argument(
        "--program",
        choices=("mpi4py", "entry", "fence"),
        default="mpi4py",
        help="mpi4py: a 10-line mpi4py hello; entry: rollout-hpc's own runtime (configs/hello.yaml); "
        "fence: does a PMIx fence without data wait for every rank (fails at once when it does not)",
    )
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="export this in the job before srun (repeatable), to try a setting",
    )
    ap.add_argument("--hang-grace", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=240, help="seconds one job may take")
    args = ap.parse_args()
    if "SLURM_CONF" not in os.environ:
        sys.exit('set SLURM_CONF (eval "$(tools/slurm_cluster.sh env DIR)")')
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mpi4py.py").write_text(HELLO)
    (args.out / "fence.py").write_text(FENCE)

    deadline = time.time() + args.jobs * 30 + 600
    burners = [multiprocessing.Process(target=burn, args=(deadline,), daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    counts = {"ok": 0, "crashed": 0, "hung": 0, "hung+crashed": 0, "lost": 0}
    failed: list[int] = []
    started = time.monotonic()
    try:
        running: dict[str, tuple[int, float]] = {}
        next_index = 0
        while next_index < args.jobs or running:
            while next_index < args.jobs and len(running) < args.parallel:
                (args.out / f"cores-{next_index}").mkdir(exist_ok=True)
                script = args.out / f"job-{next_index}.sh"
                if args.program in ("mpi4py", "fence"):
                    step = f'{args.python} -c "$(cat {args.out}/{args.program}.py)"'
                else:
                    run_dir = args.out / f"run-{next_index}"
                    r = sh(
                        args.python,
                        "-m",
                        "rollout_hpc",
                        "prepare",
                        str(REPO / "configs/hello.yaml"),
                        "--run-dir",
                        str(run_dir),
                    )
                    if r.returncode != 0:
                        sys.exit(f"rollout-hpc prepare failed: {r.stderr}")
                    step = f"{args.python} -m rollout_hpc.runtime.entry --run-dir {run_dir}"
                exports = "".join(f"export {shlex.quote(kv)}\n" for kv in args.env)
                script.write_text(
                    JOB.format(index=next_index, out=args.out, step=step, hang_grace=args.hang_grace, exports=exports)
                )
                r = sh("sbatch", "--parsable", str(script))
                if r.returncode != 0:
                    sys.exit(f"sbatch failed: {r.stderr}")
                running[r.stdout.strip().split(";")[0]] = (next_index, time.monotonic())
                next_index += 1
            time.sleep(1)
            for job_id, (index, t0) in list(running.items()):
                timed_out = time.monotonic() - t0 > args.timeout
                if job_listed(job_id) and not timed_out:
                    continue
                if timed_out:
                    sh("scancel", job_id)
                del running[job_id]
                verdict, evidence = classify(args.out, index)
                counts[verdict] += 1
                if verdict != "ok":
                    failed.append(index)
                    print(
                        f"job {job_id} (#{index}): {verdict}\n  " + evidence.strip().replace("\n", "\n  "), flush=True
                    )
    finally:
        for b in burners:
            b.terminate()
    summary = {
        "program": args.program,
        "jobs": args.jobs,
        **counts,
        "failed_indices": failed,
        "env": args.env,
        "burners": args.burners,
        "parallel": args.parallel,
        "seconds": round(time.monotonic() - started),
    }
    print(json.dumps(summary))
    return 0 if len(failed) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

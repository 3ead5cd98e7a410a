"""An environment worker process: `python -m rollout_hpc.envs.env_worker PARENT_PID` (started by ProcessEnvs,
envs/process_envs.py). Its stdio, signals and wire format: rollout_hpc/worker_process.py.

  parent -> worker: ("init", task_cfg, data_dir, step_timeout, parent_sys_path) once,
                    then ("calls", [(key, method, arg), ...]) per turn
  worker -> parent: ("ready", pid) or ("fatal", message) after init;
                    then ("replies", {key: Reply}) per calls message

The worker builds the task from the config (the same registry as the rank) and runs each batch of calls on a
ThreadEnvs host: each environment in a thread of its own, under task.env.step_timeout. It never imports mpi4py.
"""

from __future__ import annotations

import sys

from rollout_hpc.worker_process import one_line, read_message, start_worker, write_message


def main(argv: list[str]) -> int:
    started = start_worker(argv)
    if started is None:
        return 0
    stream, out, (task_cfg, data_dir, timeout) = started
    try:
        from rollout_hpc.envs.hosts import ThreadEnvs
        from rollout_hpc.envs.registry import load_task

        task = load_task(task_cfg, data_dir=data_dir)
        host = ThreadEnvs(lambda key: task.make_env(), timeout)
    except BaseException as exc:  # noqa: BLE001 - reported to the rank, which ends the run with it
        write_message(out, ("fatal", one_line(exc, 2000)))
        return 0
    write_message(out, ("ready", 0))
    while True:
        msg = read_message(stream)
        if msg is None:
            host.close()
            return 0
        write_message(out, ("replies", host.run(msg[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv))

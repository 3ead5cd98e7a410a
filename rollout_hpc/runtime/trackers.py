"""Experiment trackers (TensorBoard, Weights & Biases, MLflow), fed with the rows of the trajectory log.

`logging.trackers` names them. The trainer rank that writes RUN_DIR/trajectories.h5 attaches one `Trackers`
to its log (`attach_trackers`): every per-step metric row and eval row the log takes is handed on, so the
trackers see the same numbers as HDF5 (which stays the source of truth). A background thread does the
tracker calls, so a slow or unreachable tracker never holds the training step; a tracker that cannot be
imported, opened or written to prints ONE warning line and is dropped, and the run goes on.

Resumed runs continue the same tracker run (ids in RUN_DIR/trackers.json), each step and eval appearing once
(docs/trackers.md). Each tracker knows the last step (and eval) it holds durably; on reopening, the rows of the
log before the checkpoint it lacks are sent first (backfill from HDF5), then only later rows:
- TensorBoard: the writer is flushed whenever the log is (so before every checkpoint) and reopened with
  `purge_step = steps done`: its readers hide the events of the steps (and evals) the resumed run redoes, as the
  log drops their rows, and show the replayed values.
- MLflow: the last step of each metric is read back from the tracking store.
- W&B: online, the server's last step (`resume="allow"` with the kept id); offline, the steps the earlier
  `wandb/offline-run-*-<id>` directories hold (W&B writes its file every 15 s, so a killed rank loses the last
  seconds: those steps are backfilled or replayed). The offline directories thus hold disjoint steps, which is
  what `wandb sync --append` needs.
"""

from __future__ import annotations

import json
import math
import os
import queue
import struct
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rollout_hpc.store.atomic import write_text_atomic
from rollout_hpc.store.trajlog import log_path, read_eval, read_metrics

STATE_FILE = "trackers.json"  # RUN_DIR/trackers.json: the tracker runs' ids, for the next allocation (atomic)
FLUSH_TIMEOUT_S = 30.0  # the longest a checkpoint waits for the trackers to take the rows it covers
CLOSE_TIMEOUT_S = 120.0  # the longest the end of the run waits for trackers to finish (wandb uploads, ...)


def _warn(name: str, what: str, exc: BaseException) -> None:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, ImportError):
        what, reason = "not installed", f"{reason}; pip install 'rollout-hpc[trackers]'"
    print(
        f"warning: tracker {name} disabled ({what}: {reason}); the run goes on, RUN_DIR/trajectories.h5 has every metric",
        file=sys.stderr,
        flush=True,
    )


def _numbers(row: dict) -> dict[str, float]:
    """The finite numbers of a log row, without its own `step` and `time` columns."""
    out = {}
    for key, value in row.items():
        if key in ("step", "time"):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[key] = number
    return out


class Tracker:
    """One tracker: `open` (a fresh run, or the one of `state` when resuming after `steps_done` steps), `log` rows
    ("train": step index s, "eval": the policy version evaluated), `flush`, `close`; `state` goes to trackers.json."""

    name = "?"

    def __init__(self, cfg, run_dir: Path, state: dict):
        self.cfg, self.run_dir, self.state = cfg, run_dir, dict(state)
        self.marks = {"train": -1, "eval": -1}  # the last step of each kind the tracker holds: later ones are logged

    def open(self, steps_done: int) -> None:
        raise NotImplementedError

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        if step > self.marks[kind]:
            self.write(kind, step, values)
            self.marks[kind] = step

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def open(self, steps_done: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package (extra: trackers)

        log_dir = Path(self.cfg.logging.tensorboard.dir or self.run_dir / "tensorboard").expanduser()
        resumed = log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*"))
        # purge_step: TensorBoard's readers hide earlier events with step >= steps_done, the steps (and evals of
        # policy versions) this allocation redoes from its checkpoint.
        self.writer = SummaryWriter(str(log_dir), purge_step=steps_done if resumed else None)
        if resumed:  # flushed at every checkpoint: it holds every step before the one resumed from
            self.marks = {"train": steps_done - 1, "eval": steps_done - 1}
        else:
            text = json.dumps(self.cfg.resolved(), indent=2)
            self.writer.add_text("config", "```\n" + text + "\n```", 0)
        self.state = {"log_dir": str(log_dir)}

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{kind}/{key}", value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _flat(tree: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list | type(None)) else str(value)
    return out


class MLflowTracker(Tracker):
    name = "mlflow"

    def open(self, steps_done: int) -> None:
        section = self.cfg.logging.mlflow
        uri = section.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"file:{self.run_dir / 'mlruns'}"
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it behind this switch
        from mlflow.entities import Metric, Param  # optional dependency (extra: trackers)
        from mlflow.tracking import MlflowClient

        self._Metric = Metric
        self.client = client = MlflowClient(tracking_uri=uri)
        run_id = self.state.get("run_id") if self.state.get("tracking_uri") == uri else None
        self.logged: dict[str, int] = {}  # metric -> last step the run holds
        if run_id:
            run = client.get_run(run_id)
            for key in run.data.metrics:
                self.logged[key] = max(m.step for m in client.get_metric_history(run_id, key))
            client.update_run(run_id, status="RUNNING")
        else:
            name = section.experiment or self.cfg.run.name
            found = client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found else client.create_experiment(name)
            tags = {"rollout_hpc.run_dir": str(self.run_dir.resolve()), "rollout_hpc.config_digest": self.cfg.digest()}
            run_id = client.create_run(experiment_id, run_name=self.cfg.run.name, tags=tags).info.run_id
            params = [Param(k, v[:6000]) for k, v in _flat(self.cfg.resolved()).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                client.log_batch(run_id, params=params[i : i + 100])
        client.log_dict(run_id, self.cfg.resolved(), "config.resolved.json")
        self.run_id = run_id
        self.state = {"tracking_uri": uri, "run_id": run_id}

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = []
        for key, value in values.items():
            name = f"{kind}/{key}"
            if step > self.logged.get(name, -1):  # a step the run already holds (logged before a crash) stays once
                metrics.append(self._Metric(name, value, now, step))
                self.logged[name] = step
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker(Tracker):
    name = "wandb"

    def open(self, steps_done: int) -> None:
        import wandb  # optional dependency (extra: trackers)

        section = self.cfg.logging.wandb
        mode: Any = section.mode or os.environ.get("WANDB_MODE") or "offline"
        run_id = self.state.get("id") or uuid.uuid4().hex[:12]
        if self.state.get("id") and mode == "offline":  # what the earlier allocations' files hold
            self.marks = offline_marks(self.run_dir / "wandb", run_id)
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, init_timeout=section.init_timeout_s)
        self.run = wandb.init(
            project=section.project or os.environ.get("WANDB_PROJECT") or "rollout-hpc",
            entity=section.entity or os.environ.get("WANDB_ENTITY"),
            name=self.cfg.run.name,
            id=run_id,
            resume="allow",
            mode=mode,
            dir=str(self.run_dir),
            config=self.cfg.resolved(),
            settings=settings,
        )
        if self.run.resumed:  # online: the server's history goes on after its last step
            self.marks = {"train": self.run.starting_step - 1, "eval": int(self.run.summary.get("eval/step", -1))}
        self.run.define_metric("eval/step")
        self.run.define_metric("eval/*", step_metric="eval/step")  # evals arrive late: plotted by policy version
        self.next_step = self.marks["train"] + 1  # W&B steps only go up: an eval is logged at the current one
        self.state = {"id": run_id, "mode": mode}

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        data = {f"{kind}/{key}": value for key, value in values.items()}
        if kind == "train":
            self.run.log(data, step=step)
            self.next_step = step
        else:
            self.run.log({**data, "eval/step": step}, step=self.next_step)

    def close(self) -> None:
        self.run.finish()


def offline_records(path: Path):
    """The records of a W&B offline run file (`run-<id>.wandb`: LevelDB-log framing of protobuf `Record`s, what
    `wandb sync` reads); stops at a torn end (a killed writer)."""
    from wandb.proto import wandb_internal_pb2 as pb  # optional dependency (extra: trackers)

    data, pos, parts = path.read_bytes(), 7, b""
    if data[:4] != b":W&B":
        return
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            return
        parts, pos = parts + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last fragment of one
            record = pb.Record()  # type: ignore[attr-defined]  # a generated protobuf module
            record.ParseFromString(parts)
            parts = b""
            yield record


def offline_history(path: Path) -> list[dict]:
    """The history rows (`_step`, `train/...`, `eval/...`) of a W&B offline run file."""
    rows = []
    for record in offline_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def offline_marks(wandb_dir: Path, run_id: str) -> dict[str, int]:
    """The last train step and eval step that the offline runs of `run_id` hold on disk."""
    marks = {"train": -1, "eval": -1}
    for path in wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"):
        for row in offline_history(path):
            marks["train"] = max(marks["train"], int(row.get("_step", -1)))
            marks["eval"] = max(marks["eval"], int(row.get("eval/step", -1)))
    return marks


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoardTracker, WandbTracker, MLflowTracker)}


class Trackers:
    """An observer of the trajectory log (TrajectoryLog.observers): metric rows, eval rows, flushes and the close
    go through a queue to one thread that drives every tracker."""

    def __init__(self, cfg, run_dir: Path, steps_done: int):
        self.cfg, self.run_dir, self.steps_done = cfg, Path(run_dir), steps_done
        self.path = self.run_dir / STATE_FILE
        saved = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.trackers = [TRACKERS[name](cfg, self.run_dir, saved.get(name, {})) for name in cfg.logging.trackers]
        # a resumed run: the log rows before the checkpoint, for what a tracker lost (or all, for one added now)
        try:
            self.backfill = logged_rows(self.run_dir, steps_done) if steps_done else []
        except Exception as exc:  # never stops training: the trackers just miss what they lost
            print(f"warning: trackers get no backfill from the log ({exc})", file=sys.stderr, flush=True)
            self.backfill = []
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="trackers", daemon=True)
        self.thread.start()

    def __call__(self, event: str, step: int, row: dict) -> None:
        """What the log tells its observers: ("metrics" | "eval", step, row), ("flush", ...), ("close", ...)."""
        if event in ("metrics", "eval"):
            self.queue.put(("train" if event == "metrics" else "eval", step, _numbers(row)))
        elif event in ("flush", "close"):
            done = threading.Event()
            self.queue.put((event, step, done))
            done.wait(FLUSH_TIMEOUT_S if event == "flush" else CLOSE_TIMEOUT_S)

    def _call(self, tracker: Tracker, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a tracker's failure must never stop training: one line, then without it
            _warn(tracker.name, what, exc)
            self.trackers.remove(tracker)

    def _work(self) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, "cannot be opened", tracker.open, self.steps_done)
        for kind, step, values in self.backfill:  # what a tracker lost before the checkpoint (its marks say)
            for tracker in list(self.trackers):
                self._call(tracker, "cannot be written to", tracker.log, kind, step, values)
        self._save()
        while True:
            items = [self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get())
            for kind, step, payload in items:
                for tracker in list(self.trackers):
                    if kind in ("train", "eval"):
                        self._call(tracker, "cannot be written to", tracker.log, kind, step, payload)
                    elif kind == "flush":
                        self._call(tracker, "cannot be flushed", tracker.flush)
                    else:
                        self._call(tracker, "cannot be closed", tracker.close)
            for kind, _, payload in items:
                if kind in ("flush", "close"):
                    payload.set()
                if kind == "close":
                    return

    def _save(self) -> None:
        """RUN_DIR/trackers.json: each open tracker's run id, kept for the next allocation."""
        try:
            saved = json.loads(self.path.read_text()) if self.path.is_file() else {}
            saved.update({t.name: t.state for t in self.trackers})
            write_text_atomic(self.path, json.dumps(saved, indent=2) + "\n")
        except (OSError, ValueError) as exc:  # the trackers go on; a resume may then log a step twice
            print(f"warning: {self.path} not written ({exc})", file=sys.stderr, flush=True)


def logged_rows(run_dir: Path, steps_done: int) -> list[tuple[str, int, dict[str, float]]]:
    """The log's metric and eval rows before `steps_done`, in the order they were made (eval p before step p)."""
    rows = [("train", int(m["step"]), _numbers(m)) for m in read_metrics(log_path(run_dir))]
    rows += [("eval", int(e["step"]), _numbers(e)) for e in read_eval(log_path(run_dir))]
    return sorted((r for r in rows if r[1] < steps_done), key=lambda r: (r[1], r[0] == "train"))


def attach_trackers(log: Any, cfg, run_dir: Path, steps_done: int) -> None:
    """Feed `logging.trackers` from `log` (the TrajectoryLog the trainer's logger rank writes)."""
    if cfg.logging.trackers:
        log.observers.append(Trackers(cfg, run_dir, steps_done))

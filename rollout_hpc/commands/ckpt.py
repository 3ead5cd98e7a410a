"""rollout-hpc ckpt RUN_DIR: the newest valid checkpoint of a run (verified), and the others."""

from __future__ import annotations

import argparse
import json

from rollout_hpc.commands import out
from rollout_hpc.errors import UserError


def cmd_ckpt(args: argparse.Namespace) -> int:
    # In here (and below): store.checkpoint imports torch (seconds), and the CLI imports every command at start.
    from rollout_hpc.store.checkpoint import checkpoint_dir, list_checkpoints, load_latest_valid, weights_digest

    found = load_latest_valid(args.run_dir, shard=0 if _newest_sharded(args.run_dir) else None)
    if found is None:
        raise UserError(
            f"no checkpoints in {checkpoint_dir(args.run_dir)}; a run writes them every checkpoint.every_steps steps"
        )
    path, state, meta = found
    checkpoints = [{"step": c.step, "path": str(c.path), "sharded": c.sharded} for c in list_checkpoints(args.run_dir)]
    info = {
        "step": meta.get("step"),
        "policy_version": meta.get("policy_version"),
        "file": str(path),
        "weights_sha256": weights_digest(state),
        "content_checksum": meta.get("content_checksum"),
        "config_digest": meta.get("config_digest"),
        "created": meta.get("created"),
        "checkpoints": checkpoints,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    out.print(f"newest valid checkpoint: step {info['step']}, policy version {info['policy_version']}")
    out.print(f"  file            {info['file']}")
    out.print(f"  weights sha256  {info['weights_sha256']}")
    out.print(f"  config digest   {info['config_digest']}")
    out.print(f"  all checkpoints {', '.join(str(c['step']) for c in checkpoints)}")
    return 0


def _newest_sharded(run_dir) -> bool:
    from rollout_hpc.store.checkpoint import list_checkpoints  # imports torch: see cmd_ckpt

    found = list_checkpoints(run_dir)
    return bool(found) and found[-1].sharded


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ckpt",
        help="the newest valid checkpoint of a run: step, policy version, weights SHA-256",
        description="Verifies checkpoints newest first (a damaged one is reported and skipped).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=cmd_ckpt)

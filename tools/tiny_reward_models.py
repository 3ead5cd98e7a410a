"""Write a tiny reward classifier and a tiny LLM judge (random weights, made in code: nothing is downloaded) to try
rewards.models end to end: `python tools/tiny_reward_models.py models/` writes models/reward-classifier and
models/reward-judge, the paths configs/examples/reward-model-cpu.yaml names. They score plumbing, not quality:
the judge replies with one repeated character, so its \\boxed{N} pattern never parses (counted, scored by
parse_failure_score)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_hf import make_tiny_judge, make_tiny_reward_classifier  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write reward-classifier/ and reward-judge/ into")
    args = parser.parse_args()
    classifier = make_tiny_reward_classifier(args.out / "reward-classifier")
    judge = make_tiny_judge(args.out / "reward-judge")
    print(f"wrote {classifier} (kind: classifier) and {judge} (kind: judge)")


if __name__ == "__main__":
    main()

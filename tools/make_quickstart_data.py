"""Writes the quickstart's dataset: two-digit additions and subtractions with multi-character answers.

    python tools/make_quickstart_data.py            # configs/data/arith-{train,val}.jsonl (seeded: the same files)

Train and val share no problem; subtraction keeps the larger operand first (answers are never negative).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs" / "data"


def problems(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pairs = [(a, b, op) for a in range(10, 100) for b in range(10, 100) for op in "+-" if op == "+" or a >= b]
    rng.shuffle(pairs)
    return [{"prompt": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a - b)} for a, b, op in pairs]


def main() -> None:
    rows = problems()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, part in (("arith-train.jsonl", rows[:4000]), ("arith-val.jsonl", rows[4000:4200])):
        (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{OUT / name}: {len(part)} problems")


if __name__ == "__main__":
    main()

"""Writes the quickstart's dataset: two-digit sums whose digits add without a carry ("23+45=" -> "68"), answers of
two or three characters that end with EOS. A 2-layer model learns the digit-by-digit rule in about a minute on two
CPU cores, and the held-out problems test that rule (no problem is in both files).

    python tools/make_quickstart_data.py      # configs/data/sums-{train,val}.jsonl (seeded: always the same files)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs" / "data"


def problems(seed: int = 0) -> list[dict]:
    pairs = [
        (a, b)
        for a in range(10, 100)
        for b in range(10, 100)
        if a // 10 + b // 10 <= 9 and a % 10 + b % 10 <= 9  # no carry: each answer digit is one column's sum
    ]
    random.Random(seed).shuffle(pairs)
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def main() -> None:
    rows = problems()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, part in (("sums-train.jsonl", rows[:1800]), ("sums-val.jsonl", rows[1800:])):
        (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{OUT / name}: {len(part)} problems")


if __name__ == "__main__":
    main()

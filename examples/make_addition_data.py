"""Write data/addition.jsonl: the data file of configs/dataset.toml (2-digit additions, seeded).

    python examples/make_addition_data.py [--rows 4000] [--seed 0] [--out data/addition.jsonl]

Each row: {"id": "add-0001", "question": "12+79", "answer": "91", "carry": true}; ``carry`` says
whether the units digits carry (the built-in model's warm-start teacher slips exactly there).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="data/addition.jsonl")
    a = ap.parse_args()
    pairs = random.Random(a.seed).sample([(x, y) for x in range(100) for y in range(100)], a.rows)
    lines = [json.dumps({"id": f"add-{i:04d}", "question": f"{x}+{y}", "answer": str(x + y), "carry": x % 10 + y % 10 >= 10})
             for i, (x, y) in enumerate(pairs, 1)]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} rows to {a.out}")


if __name__ == "__main__":
    main()

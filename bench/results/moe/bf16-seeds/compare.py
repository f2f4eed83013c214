"""r3 against off per seed: python bench/results/moe/bf16-seeds/compare.py OUT_DIR [--json FILE].

For each seed s with runs ship-bf16-off-s<s> and ship-bf16-r3-s<s> (run.sh): the mean over the training steps of
mismatch/mean_abs in each arm (as ../bf16-sensitive/summarize.py) and their ratio off / r3; and the same on the
leading steps whose samples look identical in both arms (same seed, same engine, weights that have not diverged
yet), token-weighted (mismatch/tokens). "Identical" is judged from what a run records, not token by token: equal
reward/mean, mismatch/tokens, response_len/mean, tokens and moe/compared_tokens, and equal logged samples (samples.jsonl keeps
4 per step) at that step and every step before it."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "grad_norm" in r}


def _logged(run: Path) -> dict[int, list]:
    out: dict[int, list] = {}
    for line in (run / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        if s["kind"] == "train":
            out.setdefault(s["step"], []).append((s["prompt"], s["response"]))
    return {k: sorted(v) for k, v in out.items()}


def _same(a: dict, b: dict) -> bool:
    keys = ("reward/mean", "mismatch/tokens", "response_len/mean", "tokens", "moe/compared_tokens")
    return all(a.get(k) == b.get(k) for k in keys)


def compare(root: Path, seed: int) -> dict:
    off, r3 = root / f"ship-bf16-off-s{seed}", root / f"ship-bf16-r3-s{seed}"
    a, b = _rows(off), _rows(r3)
    la, lb = _logged(off), _logged(r3)
    mean = {arm: statistics.mean(r["mismatch/mean_abs"] for r in rows.values() if "mismatch/mean_abs" in r)
            for arm, rows in (("off", a), ("r3", b))}
    disagree = {arm: statistics.mean(r["moe/disagree"] for r in rows.values() if "moe/disagree" in r)
                for arm, rows in (("off", a), ("r3", b))}
    same = []
    for step in sorted(a):
        if step not in b or not _same(a[step], b[step]) or la.get(step) != lb.get(step):
            break
        same.append(step)
    tok = sum(a[s].get("mismatch/tokens", 0) for s in same)

    def weighted(rows: dict) -> float | None:
        return sum(rows[s]["mismatch/mean_abs"] * rows[s]["mismatch/tokens"] for s in same
                   if "mismatch/tokens" in rows[s]) / tok if tok else None

    ident = {"steps": same, "tokens": tok, "off": weighted(a), "r3": weighted(b)}
    return {"seed": seed, "mean_abs": mean, "ratio": mean["off"] / mean["r3"], "disagree": disagree,
            "identical": ident, "steps": len(a)}


def main() -> None:
    root = Path(sys.argv[1])
    seeds = sorted({int(d.name.rsplit("-s", 1)[1]) for d in root.iterdir() if (d / "metrics.jsonl").is_file()})
    out = [compare(root, s) for s in seeds]
    print("| seed | moe/disagree off / r3 | mismatch/mean_abs off / r3 (all steps) | off / r3 | identical steps "
          "(tokens): off / r3 |")
    print("|---|---|---|---|---|")
    for c in out:
        i = c["identical"]
        same = (f"1-{i['steps'][-1]} ({i['tokens']:.0f}): {i['off']:.5f} / {i['r3']:.5f} = {i['off'] / i['r3']:.2f}x"
                if i["steps"] else "none")
        print(f"| {c['seed']} | {c['disagree']['off']:.5f} / {c['disagree']['r3']:.5f} | {c['mean_abs']['off']:.5f} / "
              f"{c['mean_abs']['r3']:.5f} | {c['ratio']:.2f}x | {same} |")
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

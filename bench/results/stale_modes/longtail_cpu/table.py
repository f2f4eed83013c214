"""The table of README.md from the four metrics.jsonl files beside this script: python table.py."""
import json
import statistics
from pathlib import Path

rows = []
for mode in ["sync", "drop", "wait", "partial"]:
    p = Path(__file__).parent / f"{mode}.metrics.jsonl"
    if not p.exists():
        continue
    L = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    tr = [x for x in L if "samples" in x]
    if not tr:
        continue
    acc = [x["eval/accuracy"] for x in L if "eval/accuracy" in x]
    rows.append((mode, len(tr), tr[-1]["time/elapsed_s"], sum(x["time/train_s"] for x in tr),
                 statistics.fmean(x["len/trained_mean"] for x in tr), statistics.fmean(x["tokens/trained"] for x in tr),
                 sum(x["dropped/samples"] for x in tr), sum(x["dropped/tokens"] for x in tr),
                 max(x["staleness/max"] for x in tr), statistics.fmean(x["staleness/token_mean"] for x in tr),
                 statistics.fmean(x["lineage/interrupted_frac"] for x in tr), statistics.fmean(x["reward/mean"] for x in tr),
                 acc[0] if acc else None, acc[-1] if acc else None, statistics.fmean(x.get("iw/mean", float("nan")) for x in tr)))
print("| mode | steps | elapsed s | len/trained_mean | tokens/trained per step | dropped samples / tokens | staleness max | token staleness mean | interrupted | reward mean | held-out start -> end | iw/mean |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[4]:.1f} | {r[5]:.0f} | {r[6]} / {r[7]} | {r[8]} | {r[9]:.2f} | {r[10]:.1%} | {r[11]:.3f} | {r[12]} -> {r[13]} | {r[14]:.3f} |")

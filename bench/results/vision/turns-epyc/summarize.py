"""Summarize the runs of configs/vlm-turns.toml into summary.json (README.md tells the story).

    python bench/results/vision/turns-epyc/summarize.py RUNS_DIR [SEED ...]

Reads RUNS_DIR/turns-s<seed>/{metrics.jsonl,samples.jsonl}; writes summary.json and metrics-s<seed>.jsonl.xz here
(the first seed's whole; the others' main keys, KEEP, for the size budget of bench/results).
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEEP = ("step", "reward/", "eval/", "mismatch/", "time/step_s", "time/elapsed_s", "run/", "rate/", "turns/",
        "response_len/", "loss", "entropy/", "grad_norm", "mem/", "count/", "dropped/", "version", "staleness/")
EVAL = ("eval/reward_mean", "eval/accuracy", "eval/reward/turn1", "eval/reward/turn2")


def summarize(run: Path) -> dict:
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [ln for ln in lines if "eval/reward_mean" in ln]
    first, last = evals[0], evals[-1]
    out: dict = {"steps": max(ln["step"] for ln in lines), "evals": [{k: ln.get(k) for k in ("step", *EVAL)} for ln in evals]}
    for k in EVAL:
        out[k] = {"start": first.get(k), "best": max(e.get(k, 0) for e in evals), "last": last.get(k)}
    mism = [ln["mismatch/max_abs"] for ln in lines if ln.get("mismatch/max_abs") is not None]
    out["mismatch_max_abs"] = max(mism)
    out["mismatch_tokens"] = sum(ln.get("mismatch/tokens") or 0 for ln in lines)
    out["run_samples_per_s_last"] = [ln for ln in lines if ln.get("run/samples_per_s")][-1]["run/samples_per_s"]
    out["elapsed_s"] = max(ln.get("time/elapsed_s") or 0 for ln in lines)
    out["mean_step_s"] = statistics.mean(ln["time/step_s"] for ln in lines if ln.get("time/step_s"))
    out["trainer_batch_s_mean"] = statistics.mean(ln["time/trainer/batch_s"] for ln in lines if ln.get("time/trainer/batch_s"))
    out["peak_mem_gib"] = max(ln.get("mem/total_gib") or 0 for ln in lines)
    samples = [json.loads(ln) for ln in (run / "samples.jsonl").read_text().splitlines()]
    two = [s for s in samples if s["turns"] == 2 and len(s["images"]) == 2]
    out["samples_jsonl"] = {"rows": len(samples), "train_rows": sum(s["kind"] != "eval" for s in samples),
                            "rows_with_2_turns_and_2_images": len(two),
                            "example": {k: samples[-1][k] for k in ("step", "kind", "response", "answer", "reward", "metrics", "images")}}
    return out


def main() -> int:
    runs = Path(sys.argv[1])
    seeds = [int(s) for s in sys.argv[2:]] or [0]
    summary = {}
    for s in seeds:
        run = runs / f"turns-s{s}"
        summary[f"s{s}"] = summarize(run)
        raw = (run / "metrics.jsonl").read_text()
        if s != seeds[0]:  # the size budget of bench/results: the first seed whole, the others' main keys
            raw = "".join(json.dumps({k: v for k, v in json.loads(ln).items() if k.startswith(KEEP)}) + "\n"
                          for ln in raw.splitlines())
        (HERE / f"metrics-s{s}.jsonl.xz").write_bytes(lzma.compress(raw.encode(), preset=9))
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for s, r in summary.items():
        print(s, {k: r[k] for k in EVAL}, "mismatch", r["mismatch_max_abs"], "samples/s", r["run_samples_per_s_last"],
              "elapsed", r["elapsed_s"], r["samples_jsonl"]["rows_with_2_turns_and_2_images"], "/", r["samples_jsonl"]["rows"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

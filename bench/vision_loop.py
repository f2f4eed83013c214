"""configs/vlm.toml through flashrl's real loop: seeds, async against sync, memory, image preprocessing (issue 54).

    .venv/bin/python bench/vision_loop.py --out bench/results/vision/loop-epyc [--seeds 0 1 2] [--sync-seed 0]
                                          [--steps 100]

Each arm is one `flashrl run configs/vlm.toml` (builtin:vlm, warm-started by `flashrl init-model`, cached; envs/digits;
1 vLLM CPU engine, 1 trainer rank, the controller) with --set run.seed / scheduler.async_ratio; arms run one at a
time. Writes to --out: summary.json (per arm: held-out greedy accuracy at step 0, at the end and best, wall
seconds, peak memory of all processes, mean step and trainer batch seconds, train/inference mismatch, bad images),
metrics-<arm>.jsonl.xz (the run's metrics.jsonl), and preprocess.json: the cost of one image where it is paid
(decoding a PNG reference, as the engine server does in a thread; the image processor, as vLLM's input processing
in the engine process and the trainer's PixelCache do), measured here on the training images, cold.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _run(arm: str, seed: int, async_ratio: int, steps: int, out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs/vlm.toml"), "--set", f"run.seed={seed}",
           "--set", f"scheduler.async_ratio={async_ratio}", "--set", f"run.steps={steps}", "--set", f"run.name={arm}",
           "--set", f"run.output_dir={out_dir}", "--set", "run.dashboard=plain"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if proc.returncode != 0:
        raise RuntimeError(f"{arm}: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    run = out_dir / arm
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_ = [r for r in rows if r.get("step", 0) >= 1]
    mism = [r["mismatch/max_abs"] for r in steps_ if "mismatch/max_abs" in r]
    return {"arm": arm, "seed": seed, "async_ratio": async_ratio, "steps": summary["steps"],
            "eval_first": summary["eval_first"], "eval_last": summary["eval_last"], "eval_best": summary["eval_best"],
            "evals": [[e["step"], e["accuracy"]] if isinstance(e, dict) else e for e in summary.get("evals", [])],
            "wall_s": summary["wall_s"], "process_wall_s": round(time.monotonic() - t0, 1),
            "peak_mem_gib": summary["peak_mem_gib"],
            "step_s_mean": round(statistics.mean(r["time/step_s"] for r in steps_ if "time/step_s" in r), 4)
            if any("time/step_s" in r for r in steps_) else None,
            "trainer_batch_s_mean": round(statistics.mean(r["time/trainer/batch_s"] for r in steps_), 4),
            "mismatch_max_abs": max(mism) if mism else None,
            "bad_images": rows[-1].get("count/rollout/failed_bad_image", 0),
            "metrics": (run / "metrics.jsonl").read_bytes()}


def _preprocess(seed: int, n: int = 200) -> dict:
    from envs.digits import DigitsSuite
    from flashrl.config import load
    from flashrl.vision.build import ensure_policy
    from flashrl.vision.images import load_image
    from flashrl.vision.processor import load_processor

    cfg = load(ROOT / "configs/vlm.toml", [f"run.seed={seed}"])
    proc = load_processor(ensure_policy(cfg, build=False))
    refs = [t.meta["images"][0] for t in DigitsSuite(DigitsSuite.Params(), seed=seed, eval_size=30).train_tasks()[:n]]
    t0 = time.perf_counter()
    imgs = [load_image(r) for r in refs]
    t1 = time.perf_counter()
    for im in imgs:
        proc.image_processor(images=[[im]], return_tensors="pt")
    t2 = time.perf_counter()
    return {"images": n, "png_bytes_mean": round(statistics.mean(len(r) for r in refs)),
            "decode_ms_per_image": round((t1 - t0) / n * 1e3, 3),
            "processor_ms_per_image": round((t2 - t1) / n * 1e3, 3),
            "where": {"controller": "nothing: it forwards the references (bytes or a path), never decodes",
                      "engine": "decode in a thread of the engine server (off its event loop), then vLLM's input "
                                "processor (the same image processor) in the engine process, per request",
                      "trainer": "decode + image processor once per distinct image per rank (PixelCache, the "
                                 "batch phase: time/trainer/batch_s)"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--sync-seed", type=int, nargs="*", default=[0])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    arms = [(f"async-s{s}", s, 1) for s in args.seeds] + [(f"sync-s{s}", s, 0) for s in args.sync_seed]
    results = []
    with tempfile.TemporaryDirectory(prefix="vision-loop-") as tmp:
        for arm, seed, ratio in arms:
            r = _run(arm, seed, ratio, args.steps, Path(tmp))
            (out / f"metrics-{arm}.jsonl.xz").write_bytes(lzma.compress(r.pop("metrics")))
            results.append(r)
            print(json.dumps(r), flush=True)
            (out / "summary.json").write_text(json.dumps({"commit": commit, "host": platform.processor() or platform.machine(),
                                                          "steps": args.steps, "arms": results}, indent=1))
    pre = _preprocess(args.seeds[0] if args.seeds else 0)
    (out / "preprocess.json").write_text(json.dumps(pre, indent=1))
    print(json.dumps(pre), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

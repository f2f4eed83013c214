"""The engine's memory and time for one weight sync, weight_sync.load "whole" against "bucket", through vLLM.

    flock /tmp/flashrl-realsize.lock .venv/bin/python bench/sync_load.py --model /tmp/realsize/model \\
        --out bench/results/realsize/sync-load.md

This process is trainer rank 0 (``build_manifest`` buckets, ``WeightSender``); for each mode a fresh engine
process builds vLLM's ``LLMEngine`` in-process on the model with flashrl's own engine arguments
(``engine_kwargs``, ``EngineSpec(sync_load=mode)``) and runs ``--syncs`` syncs exactly as the engine server's
``update_weights`` calls its worker: whole: ``flashrl_receive_weights`` (beside generation) then
``flashrl_load_weights`` (generation stopped); bucket: ``flashrl_open_stream`` then ``flashrl_load_stream``. No
request is generating meanwhile (the worker's time, not the server's pause for a running step).

Per sync the engine reports: its receive buffers held (``extra_bytes``: engine/sync_extra_bytes), the time beside
generation and the time generation is stopped, and its resident memory: before the sync, at the sync's peak
(VmHWM, reset through /proc/self/clear_refs before each sync) and after it (what stays until the next sync).
Sync 1 of a mode pays first-touch page faults of its buffers; later ones reuse them (CPU engines).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _status(field: str) -> int:
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith(field + ":"):
            return int(ln.split()[1]) * 1024
    return 0


def _engine(args: argparse.Namespace) -> int:
    """The engine end: vLLM in this process, one sync per manifest line on stdin, one JSON line per sync."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from flashrl.engine.server import EngineSpec, engine_kwargs

    t0 = time.perf_counter()
    llm = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(EngineSpec(
        address="ipc://unused", model=args.model, max_model_len=128, kv_cache_gib=0.25, sync_load=args.mode))))
    print(json.dumps({"ready_s": time.perf_counter() - t0, "rss": _status("VmRSS")}), flush=True)
    llm.collective_rpc("flashrl_init_weight_sync", args=("127.0.0.1", args.port, 1, 2, "gloo", 600.0))
    first, second = (("flashrl_open_stream", "flashrl_load_stream") if args.mode == "bucket"
                     else ("flashrl_receive_weights", "flashrl_load_weights"))
    for line in sys.stdin:
        manifest_json = line.strip()
        if not manifest_json:
            break
        version = json.loads(manifest_json)["version"]
        rss0 = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the next peak is this sync's
        print(json.dumps({"go": version}), flush=True)  # the sender starts its broadcast now
        t0 = time.perf_counter()
        got = llm.collective_rpc(first, args=(manifest_json,))[0]
        t1 = time.perf_counter()
        res = llm.collective_rpc(second, args=(version,))[0] if got["ok"] else {"ok": False, "error": got["error"]}
        t2 = time.perf_counter()
        print(json.dumps({"version": version, "ok": bool(res["ok"]), "error": res.get("error", ""),
                          "beside_s": t1 - t0, "stopped_s": t2 - t1, "total_s": t2 - t0,
                          "verify_s": got.get("verify_s", 0.0) + res.get("verify_s", 0.0),
                          "extra_bytes": max(got.get("extra_bytes", 0), res.get("extra_bytes", 0)),
                          "rss_before": rss0, "rss_peak": _status("VmHWM"), "rss_after": _status("VmRSS")}), flush=True)
    return 0


def _mode(args: argparse.Namespace, mode: str, manifest, buckets) -> dict:  # noqa: ANN001
    import msgspec

    from flashrl.trainer.weights import WeightSender
    from flashrl.wire.transport import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--model", args.model, "--role", "engine", "--mode", mode, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None

    def line() -> dict:
        while True:
            text = proc.stdout.readline()  # type: ignore[union-attr]
            if not text:
                raise SystemExit(f"{mode} engine exited (code {proc.wait()})")
            if text.startswith("{"):
                return json.loads(text)

    ready = line()
    sender = WeightSender()
    sender.join("engine", "127.0.0.1", port, "gloo", 600.0)
    syncs = []
    for k in range(args.syncs):
        m = msgspec.structs.replace(manifest, version=k + 1)
        proc.stdin.write(msgspec.json.encode(m).decode() + "\n")
        proc.stdin.flush()
        line()  # "go"
        send_s, failed = sender.send(buckets)
        if failed:
            raise SystemExit(f"{mode}: send failed: {failed}")
        rec = line()
        rec["send_s"] = send_s
        if not rec["ok"]:
            raise SystemExit(f"{mode}: sync {k + 1} failed: {rec['error']}")
        syncs.append(rec)
        print(mode, json.dumps(rec), flush=True)
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=120)
    return {"ready": ready, "syncs": syncs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--modes", default="whole,bucket")
    ap.add_argument("--role", choices=["engine"])
    ap.add_argument("--mode", choices=["whole", "bucket"], default="whole")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.role:
        return _engine(args)

    import torch
    from safetensors.torch import load_file

    from flashrl.wire.weights import build_manifest, manifest_nbytes

    torch.set_num_threads(1)
    sd = load_file(os.path.join(args.model, "model.safetensors"))
    manifest, buckets = build_manifest(sd, 1, args.bucket_mb)
    del sd
    nbytes = manifest_nbytes(manifest)
    results = {mode: _mode(args, mode, manifest, buckets) for mode in args.modes.split(",")}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    biggest = max(b.numel() * b.element_size() for b in buckets)

    def med(mode: str, key: str, later: bool = True) -> float:
        rows = results[mode]["syncs"][1:] if later and len(results[mode]["syncs"]) > 1 else results[mode]["syncs"]
        return statistics.median(r[key] for r in rows)

    lines = [
        "# The engine's extra memory and time per weight sync: weight_sync.load whole vs bucket",
        "",
        f"`python bench/sync_load.py --model {args.model} --syncs {args.syncs} --bucket-mb {args.bucket_mb:g}` on "
        f"{cpu} ({os.cpu_count()} cores, shared with other jobs: timings are noisy). One vLLM CPU engine per mode "
        f"(1 thread), this process as trainer rank 0 over gloo; nothing generating during the syncs.",
        "",
        f"One sync: {nbytes} bytes ({nbytes / GIB:.2f} GiB), {len(manifest.buckets)} buckets of <= "
        f"{args.bucket_mb:g} MiB (largest {biggest / 2**20:.0f} MiB).",
        "",
        "Medians of syncs 2..N (sync 1 pays first-touch page faults of fresh buffers; its numbers in the JSON):",
        "",
        "| | whole | bucket |",
        "| --- | ---: | ---: |",
    ]
    modes = [m for m in ("whole", "bucket") if m in results]

    def row(label: str, key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
        cells = [fmt.format(med(m, key) / scale) for m in modes]
        return f"| {label} | " + " | ".join(cells) + " |"

    lines += [
        row("engine/sync_extra_bytes (receive buffers held), MiB", "extra_bytes", 2**20, "{:.0f}"),
        row("engine RSS before the sync, GiB", "rss_before", GIB),
        row("engine RSS peak during the sync, GiB", "rss_peak", GIB),
        row("engine RSS after the sync (held until the next), GiB", "rss_after", GIB),
        row("time beside generation (receive, verify), s", "beside_s"),
        row("time generation is stopped (load; bucket: + receive + verify), s", "stopped_s"),
        row("whole sync, engine's clock, s", "total_s"),
        row("of which sha256 verify, s", "verify_s"),
        row("trainer's send, s", "send_s"),
        "",
        "First sync of each mode (fresh buffers): "
        + "; ".join(f"{m}: stopped {results[m]['syncs'][0]['stopped_s']:.2f} s, whole {results[m]['syncs'][0]['total_s']:.2f} s, "
                    f"RSS peak {results[m]['syncs'][0]['rss_peak'] / GIB:.2f} GiB" for m in modes) + ".",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"nbytes": nbytes, "buckets": len(manifest.buckets), "biggest_bucket": biggest, "results": results},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

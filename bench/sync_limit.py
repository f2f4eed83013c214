"""The weight sync of a real-size model against this machine's own limits for the same bytes.

    .venv/bin/python bench/sync_limit.py --model /tmp/realsize/model --run runs/realsize \\
        --out bench/results/realsize/sync.md

Measures, for the model's weights (float32, tied lm_head dropped as the sync does), each best of
``--repeats``:

- memcpy: one copy of that many bytes in this process (``Tensor.copy_``), the floor of any move;
- raw broadcast: one flat tensor of the same bytes, gloo, between two processes (the sync's own
  ``join_group``), the floor of the transport;
- the sync's transport (serial: fresh buffers, each bucket verified before the next is received;
  the default, engine/weights.py's ``WeightReceiver.receive``: bucket i verified while i+1 transfers,
  into the buffers the previous sync released; its first repeat has only fresh buffers): ``build_manifest`` buckets (``weight_sync.bucket_mb``) sent by the trainer's
  ``WeightSender`` to the engine's ``WeightReceiver`` (flashrl/engine/weights.py: fresh buffers, every
  checksum verified, views unpacked) in a second process, as a run does minus vLLM's load;

and reads the run's own sync phases from ``--run``'s metrics.jsonl (pack, send, engine receive /
verify / load: ``time/sync/*``). The engine's extra memory during a sync is the receive buffers: every
bucket is held until all verified (engine/weights.py), i.e. the whole model's bytes once more (with
weight_sync.load = "whole"; "bucket" bounds it to a few buckets: bench/sync_load.py measures both).
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
GB = 1e9


def _state_dict(model: str) -> dict:
    import torch
    from safetensors.torch import load_file

    sd = load_file(os.path.join(model, "model.safetensors"))
    return {k: v.to(torch.float32) for k, v in sd.items()}


def _child(args: argparse.Namespace) -> int:
    """One end of the broadcast (--role send|recv): prints one JSON line of seconds per repeat."""
    import torch

    from flashrl.wire.weights import build_manifest, join_group

    torch.set_num_threads(1)
    rank = 0 if args.role == "send" else 1
    times = []
    if args.mode == "raw":
        flat = torch.ones(args.nbytes // 4, dtype=torch.float32) if rank == 0 else torch.empty(args.nbytes // 4)
        group = join_group("127.0.0.1", args.port, rank, 2, "gloo", 600.0)
        for _ in range(args.repeats):
            group.broadcast(flat, 0).wait()  # type: ignore[union-attr]  # bound in C++
            t0 = time.perf_counter()
            group.broadcast(flat, 0).wait()  # type: ignore[union-attr]
            times.append(time.perf_counter() - t0)
    else:
        sd = _state_dict(args.model)
        manifest, buckets = build_manifest(sd, 1, args.bucket_mb)
        del sd
        if rank == 0:
            from flashrl.trainer.weights import WeightSender

            sender = WeightSender()
            sender.join("engine", "127.0.0.1", args.port, "gloo", 600.0)
            for _ in range(args.repeats):
                sender.send([torch.ones(1)])  # the start mark: both ends ready
                seconds, failed = sender.send(buckets)
                if failed:
                    raise RuntimeError(f"send failed: {failed}")
                times.append(seconds)
        else:
            from flashrl.engine.weights import WeightReceiver

            del buckets
            recv = WeightReceiver()
            recv.init("127.0.0.1", args.port, 1, 2, "gloo", 600.0)
            for _ in range(args.repeats):
                recv._group.broadcast(torch.empty(1), 0).wait()  # type: ignore[union-attr]  # the start mark
                t0 = time.perf_counter()
                named, errors = recv.receive(manifest, overlap=args.mode == "sync")
                times.append(time.perf_counter() - t0)
                if errors:
                    raise RuntimeError(f"receive failed: {errors[:2]}")
                del named
                if args.mode == "sync":
                    recv.release()  # as the engine does after a load: the next receive reuses the buffers
    print(json.dumps({"role": args.role, "times": times}), flush=True)
    return 0


def _pair(args: argparse.Namespace, mode: str, nbytes: int) -> dict[str, list[float]]:
    from flashrl.wire.transport import free_port

    port = free_port()
    base = [sys.executable, __file__, "--model", args.model, "--mode", mode, "--port", str(port), "--nbytes", str(nbytes),
            "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*base, "--role", r], stdout=subprocess.PIPE, text=True, env=env) for r in ("send", "recv")]
    out = {}
    for p in procs:
        stdout, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{mode} broadcast child failed (exit {p.returncode})")
        rec = json.loads(stdout.strip().splitlines()[-1])
        out[rec["role"]] = rec["times"]
    return out


def _run_sync(run: Path) -> dict[str, float]:
    """Median per-step sync phases of a run (steps >= 2: step 1 pays first-touch costs)."""
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if r.get("step", 0) >= 2 and "time/sync/send_s" in r]
    keys = ["time/weight_sync_s", "time/sync/trainer/pack_s", "time/sync/send_s", "time/sync/engine/receive_s",
            "time/sync/engine/verify_s", "time/sync/engine/load_s"]
    return {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)} | {"steps": len(rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--run", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--role", choices=["send", "recv"])
    ap.add_argument("--mode", choices=["raw", "sync", "serial"], default="raw")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--nbytes", type=int, default=0)
    args = ap.parse_args()
    if args.role:
        return _child(args)

    import torch

    from flashrl.wire.weights import build_manifest

    torch.set_num_threads(1)
    sd = _state_dict(args.model)
    manifest, buckets = build_manifest(sd, 1, args.bucket_mb)
    nbytes = sum(b.numel() * b.element_size() for b in buckets)
    params = sum(v.numel() for v in sd.values())
    del sd, buckets
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    memcpy = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        memcpy.append(time.perf_counter() - t0)
    del src, dst
    memcpy_s = min(memcpy[1:])
    raw = _pair(args, "raw", nbytes)
    raw_s = min(raw["recv"])
    serial = _pair(args, "serial", nbytes)
    sync = _pair(args, "sync", nbytes)
    serial_s = min(serial["recv"])
    later = slice(1, None) if args.repeats > 1 else slice(None)  # repeat 0 has no released buffers to reuse
    sync_send_s, sync_recv_s = min(sync["send"][later]), min(sync["recv"][later])
    run = _run_sync(Path(args.run)) if args.run else {}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())

    def rate(s: float) -> str:
        return f"{nbytes / s / GB:.2f} GB/s"

    lines = [
        f"# Weight sync of a {params / 1e9:.2f}B-parameter model against the machine's limits",
        "",
        f"`python bench/sync_limit.py --model {args.model} --run {args.run} --bucket-mb {args.bucket_mb:g}` on {cpu} "
        f"({os.cpu_count()} cores, shared with other jobs: timings are noisy), best of {args.repeats}.",
        "",
        f"Bytes of one full sync: {nbytes} ({nbytes / 2**30:.2f} GiB, float32, {len(manifest.buckets)} buckets of "
        f"<= {args.bucket_mb:g} MiB).",
        "",
        "| what | seconds | throughput | time / raw broadcast |",
        "| --- | ---: | ---: | ---: |",
        f"| memcpy (one copy in one process) | {memcpy_s:.3f} | {rate(memcpy_s)} | {memcpy_s / raw_s:.2f} |",
        f"| raw gloo broadcast, one flat tensor, 2 processes | {raw_s:.3f} | {rate(raw_s)} | 1.00 |",
        f"| sync transport, serial: WeightSender -> WeightReceiver, verify after each receive | {serial_s:.3f} "
        f"| {rate(serial_s)} | {serial_s / raw_s:.2f} |",
        f"| sync transport, first sync (overlapped, fresh buffers) | {sync['recv'][0]:.3f} "
        f"| {rate(sync['recv'][0])} | {sync['recv'][0] / raw_s:.2f} |",
        f"| sync transport, later syncs (the default: overlapped, reused buffers) | {sync_recv_s:.3f} "
        f"| {rate(sync_recv_s)} | {sync_recv_s / raw_s:.2f} |",
        f"| (same, the sender's clock) | {sync_send_s:.3f} | {rate(sync_send_s)} | {sync_send_s / raw_s:.2f} |",
    ]
    if run:
        lines += [
            "",
            f"The run's own syncs (`{args.run}`, median of steps >= 2, {run['steps']} steps; 1 engine, 1 trainer rank):",
            "",
            "| phase | seconds | throughput |",
            "| --- | ---: | ---: |",
        ]
        names = {"time/weight_sync_s": "whole sync (controller's clock)", "time/sync/trainer/pack_s": "trainer: pack + sha256",
                 "time/sync/send_s": "trainer: send (broadcast)", "time/sync/engine/receive_s": "engine: receive + verify",
                 "time/sync/engine/verify_s": "engine: verify (sha256)",
                 "time/sync/engine/load_s": "engine: load (generation stopped)"}
        for k, label in names.items():
            if k in run:
                lines.append(f"| {label} | {run[k]:.2f} | {rate(run[k])} |")
    lines += [
        "",
        f"Engine memory: every bucket is received into buffers of its own and held until all verified and "
        f"loaded: {nbytes} bytes ({nbytes / 2**30:.2f} GiB), one more copy of the weights; on a CPU engine "
        f"those host buffers stay allocated between syncs (reused: no page faults), on a GPU torch's caching "
        f"allocator keeps them the same way.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"nbytes": nbytes, "params": params, "memcpy_s": memcpy, "raw": raw, "serial": serial, "sync": sync,
             "run": run}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step time with and without a checkpoint in flight: one trainer rank (world 1), no engine, no controller.

    python bench/ckpt_async.py --device cuda --size 0.25b --steps 6            # a GPU machine, ~1-2 min
    python bench/ckpt_async.py --device cpu --model /tmp/realsize/model --steps 4 --out ckpt_async.jsonl

Builds the chat model's architecture at ``--size`` (flashrl/models/chat_model.py SIZES: random weights,
no tokenizer: the trainer needs none) or loads ``--model``, then, on the same Trainer (flashrl/trainer/worker.py,
the code a run uses) and a synthetic batch, one warm-up step and ``--steps`` rounds of three steps each,
interleaved so that a shared host's drift hits the three alike:

    none           a step with no checkpoint
    async-process  a background checkpoint (DCP model + AdamW + RNG; trainer.checkpoint_async = true) written by
                   a writer process (trainer.checkpoint_writer = "process"): staged, then the step runs while
                   the writer writes; a second thread waits for the write and seals it (Trainer.finish_checkpoint,
                   what rank 0's seal thread does in a run); the round waits for the seal
    async-thread   the same, written by a thread of the trainer (checkpoint_writer = "thread")
    sync           a blocking checkpoint (trainer.checkpoint_async = false), then a step

(``--writers`` picks the background writers; the staging buffers are in shared memory for both, as the
process writer needs.) Before the rounds, each writer's first background checkpoint is made and reported on
its own (``first_checkpoint``): it allocates the staging buffers and starts the writer process, once a run.

One JSON line per step (round, mode, step_s, step_cpu_s: the step's thread CPU time (on a CPU host shared with
other jobs the wall time mostly measures them), blocked_s: what the checkpoint call blocked before the step,
write_s: the background write staged-to-sealed, overlap_s: how much of the step ran beside it,
write_after_step_s: how long it outlasted the step), then a summary line: median step per mode, the async
step's overhead against the none step (of the medians, and per round), the blocking times. Every line goes
to stdout and, with ``--out``, to that file. Any failure raises (non-zero exit).

Needs torch, transformers, safetensors and msgspec (flashrl's config and wire structs), not vLLM or pyzmq.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build_model(out: Path, size: str, device: str) -> Path:
    """A random-weight Qwen3 of SIZES[size] (chat_model's shapes), float32 safetensors, no tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from flashrl.models.chat_model import SIZES

    g = SIZES[size]
    config = Qwen3Config(vocab_size=g["vocab_size"], hidden_size=g["hidden"], intermediate_size=g["intermediate"],
                         num_hidden_layers=g["layers"], num_attention_heads=g["heads"],
                         num_key_value_heads=g["kv_heads"], head_dim=g["hidden"] // g["heads"],
                         max_position_embeddings=g["max_position"], tie_word_embeddings=False, rope_theta=10000.0,
                         initializer_range=g["init_std"], bos_token_id=0, eos_token_id=1, pad_token_id=0,
                         torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def make_batch(step: int, vocab: int, groups: int, group_size: int, prompt_len: int, response_len: int) -> Any:
    """``groups`` x ``group_size`` samples; half of each group rewarded 1: non-zero advantages, every step moves."""
    import random

    from flashrl.wire.protocol import TrainBatch
    from flashrl.wire.trajectory import Trajectory

    rng = random.Random(step)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(2, vocab) for _ in range(prompt_len)]
        for j in range(group_size):
            resp = [rng.randrange(2, vocab) for _ in range(response_len)]
            samples.append(Trajectory(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * response_len,
                                       behav_logp=[-5.0] * response_len, versions=[step] * response_len,
                                       reward=float(j % 2), group=g, sample_id=f"{step}-{g}-{j}"))
    return TrainBatch(step=step, samples=samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", default="0.25b", help="a chat_model SIZES shape to build (ignored with --model)")
    ap.add_argument("--model", type=Path, default=None, help="an existing model folder instead of building one")
    ap.add_argument("--steps", type=int, default=4, help="rounds of three timed steps (none, async, sync)")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--writers", default="process,thread", help="background writers to time, comma-separated")
    ap.add_argument("--workdir", type=Path, default=None, help="where the model and checkpoints go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    writers = [w for w in a.writers.split(",") if w]
    if not writers or any(w not in ("process", "thread") for w in writers):
        ap.error("--writers: a comma-separated list of process, thread")
    modes = ["none", *(f"async-{w}" for w in writers), "sync"]
    try:
        import msgspec  # noqa: F401  (flashrl's config and messages)
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"ckpt_async: {e}; this bench needs torch, transformers and msgspec (pip install msgspec)", file=sys.stderr)
        return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("ckpt_async: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from flashrl.config import from_dict
    from flashrl.trainer.worker import Trainer
    from flashrl.wire.rendezvous import init_default_group

    out_f = open(a.out, "w") if a.out else None  # noqa: SIM115 - closed at the end

    def emit(rec: dict[str, Any]) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if out_f is not None:
            out_f.write(line + "\n")
            out_f.flush()

    work = a.workdir or Path(tempfile.mkdtemp(prefix="flashrl-ckpt-async-"))
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if a.device == "cuda" else "gloo"
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    model = a.model if a.model is not None else build_model(work / "model", a.size, a.device)
    build_s = time.perf_counter() - t0
    init_default_group(backend, 0, 1, datetime.timedelta(minutes=10))
    try:
        cfg = from_dict({
            "model": {"dtype": "bfloat16" if a.device == "cuda" else "float32"},
            "trainer": {"lr": 1e-5, "threads": a.threads, "warmup_steps": 0, "backend": backend, "skip_inert": False,
                        "checkpoint_writer": writers[0]},
            "algorithm": {"loss": "ppo"},
        })
        t0 = time.perf_counter()
        trainer = Trainer(cfg, str(model), device)
        load_s = time.perf_counter() - t0
        params = sum(p.numel() for p in trainer.model.parameters())
        vocab = int(trainer.model.config.vocab_size)
        host = {"device": a.device, "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
                "torch": torch.__version__, "cpus": os.cpu_count(), "threads": a.threads}
        emit({"event": "setup", "model": str(model), "params": params, "build_s": round(build_s, 2),
              "load_s": round(load_s, 2), "sharded": trainer.sharded, "batch": [a.groups, a.group_size, a.prompt_len,
              a.response_len], "checkpoint_timeout_s": trainer.checkpoint_timeout_s, **host})

        def sync_dev() -> None:
            if a.device == "cuda":
                torch.cuda.synchronize()

        step_no = [0]

        cpu_s = [0.0]

        def one_step() -> float:
            """The step's wall time; ``cpu_s[0]``: this thread's CPU time in it (with one torch thread the step's
            compute runs on it), which a shared host's other jobs do not inflate as they do the wall time."""
            batch = make_batch(step_no[0], vocab, a.groups, a.group_size, a.prompt_len, a.response_len)
            sync_dev()
            t, c = time.perf_counter(), time.thread_time()
            trainer.train_step(batch)
            sync_dev()
            step_no[0] += 1
            cpu_s[0] = time.thread_time() - c
            return time.perf_counter() - t

        one_step()  # warm-up: first-touch costs, not timed
        # each writer's first background checkpoint, reported on its own and not a round: it allocates the staging
        # buffers and (process) starts the writer process, once per run
        for w in writers:
            trainer.checkpoint_writer = w
            path = str(work / f"ckpt-first-{w}")
            t = time.perf_counter()
            trainer.save_checkpoint(path, background=True)
            blocked = time.perf_counter() - t
            write_s = trainer.finish_checkpoint(path, trainer.checkpoint_timeout_s)
            shutil.rmtree(path, ignore_errors=True)
            emit({"event": "first_checkpoint", "writer": w, "blocked_s": round(blocked, 4), "write_s": round(write_s, 3)})
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(a.steps):
            for mode in modes:
                background = mode.startswith("async")
                if background:
                    trainer.checkpoint_writer = mode.removeprefix("async-")
                path = str(work / f"ckpt-{mode}-{r}")
                blocked = overlap = tail = write_s = 0.0
                sealer: threading.Thread | None = None
                sealed: dict[str, Any] = {}
                if mode != "none":
                    sync_dev()
                    t = time.perf_counter()
                    trainer.save_checkpoint(path, background=background)
                    blocked = time.perf_counter() - t
                if background:
                    def seal(path: str = path, sealed: dict[str, Any] = sealed) -> None:
                        try:
                            sealed["write_s"] = trainer.finish_checkpoint(path, trainer.checkpoint_timeout_s)
                        except BaseException as e:  # noqa: BLE001 - raised below
                            sealed["error"] = e
                        sealed["at"] = time.perf_counter()

                    sealer = threading.Thread(target=seal, name="seal", daemon=True)
                    sealer.start()
                t_start = time.perf_counter()
                st = one_step()
                t_end = time.perf_counter()
                if sealer is not None:
                    sealer.join(trainer.checkpoint_timeout_s + 60)
                    if sealer.is_alive():
                        raise RuntimeError(f"the background checkpoint of {path} did not finish in time")
                    if "error" in sealed:
                        raise RuntimeError(f"the background checkpoint of {path} failed: {sealed['error']}") from sealed["error"]
                    tail = time.perf_counter() - t_end  # the write outlasted the step by this much
                    overlap = min(t_end, sealed["at"]) - t_start  # how much of the step ran beside the write
                    write_s = sealed["write_s"]
                if mode != "none" and not (Path(path) / "trainer.json").is_file():
                    raise RuntimeError(f"{path}: the checkpoint is not complete (no trainer.json)")
                shutil.rmtree(path, ignore_errors=True)
                row = {"round": r, "mode": mode, "step_s": round(st, 4), "step_cpu_s": round(cpu_s[0], 4),
                       "blocked_s": round(blocked, 4),
                       "write_s": round(write_s, 3), "overlap_s": round(overlap, 3), "write_after_step_s": round(tail, 3)}
                rows[mode].append(row)
                emit(row)
        med = {m: statistics.median(x["step_s"] for x in v) for m, v in rows.items()}
        cpu = {m: statistics.median(x["step_cpu_s"] for x in v) for m, v in rows.items()}
        summary: dict[str, Any] = {"event": "summary", "rounds": a.steps,
                                   "median_step_s": {m: round(v, 4) for m, v in med.items()},
                                   "median_step_cpu_s": {m: round(v, 4) for m, v in cpu.items()}}
        for m in modes:
            if not m.startswith("async"):
                continue
            paired = [100 * (y["step_s"] / x["step_s"] - 1) for x, y in zip(rows["none"], rows[m])]
            summary[m] = {"step_overhead_pct_median": round(100 * (med[m] / med["none"] - 1), 1),
                          "step_overhead_pct_paired": [round(x, 1) for x in paired],
                          "step_cpu_overhead_pct_median": round(100 * (cpu[m] / cpu["none"] - 1), 1),
                          "blocked_s": [x["blocked_s"] for x in rows[m]], "write_s": [x["write_s"] for x in rows[m]],
                          "overlap_s": [x["overlap_s"] for x in rows[m]]}
        summary["sync_blocked_s"] = [x["blocked_s"] for x in rows["sync"]]
        summary["sync_cost_pct_median"] = round(100 * statistics.median(x["blocked_s"] for x in rows["sync"]) / med["none"], 1)
        emit(summary)
        trainer.close_checkpoints(60.0)
    finally:
        dist.destroy_process_group()
        if out_f is not None:
            out_f.close()
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

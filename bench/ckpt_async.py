"""Step time with and without a checkpoint in flight: one trainer rank (world 1), no engine, no controller.

    python bench/ckpt_async.py --device cuda --size 0.25b --steps 6            # a GPU machine, ~1-2 min
    python bench/ckpt_async.py --device cpu --model /tmp/realsize/model --steps 4 --out ckpt_async.jsonl

Builds the chat model's architecture at ``--size`` (flashrl/models/chat_model.py SIZES: random weights,
no tokenizer: the trainer needs none) or loads ``--model``, then runs three phases of ``--steps`` training
steps each on the same Trainer (flashrl/trainer/worker.py, the code a run uses), on a synthetic batch:

    none   no checkpoint
    sync   a blocking DCP checkpoint (model + AdamW + RNG) before the phase's first step (trainer.checkpoint_async = false)
    async  a background checkpoint before the phase's first step: staged, then written by DCP's thread
           while the steps run; a second thread waits for the write and seals it (Trainer.finish_checkpoint,
           what rank 0's seal thread does in a run), as the controller's completion task would ask

Each phase starts with one warm-up step (not timed). Prints one JSON line per step (phase, step, step_s,
ckpt_s: the time the checkpoint call blocked before that step, in_flight: whether the background write
was still running when the step ended) and one summary line per phase, then an ``overhead`` line: the
median step with a write in flight against the median of the ``none`` phase. Every line goes to stdout
and, with ``--out``, to that file. Any failure raises (non-zero exit).

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

    from flashrl.wire.protocol import TrainBatch, TrainSample

    rng = random.Random(step)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(2, vocab) for _ in range(prompt_len)]
        for j in range(group_size):
            resp = [rng.randrange(2, vocab) for _ in range(response_len)]
            samples.append(TrainSample(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * response_len,
                                       behav_logp=[-5.0] * response_len, versions=[step] * response_len,
                                       reward=float(j % 2), group=g, sample_id=f"{step}-{g}-{j}"))
    return TrainBatch(step=step, samples=samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", default="0.25b", help="a chat_model SIZES shape to build (ignored with --model)")
    ap.add_argument("--model", type=Path, default=None, help="an existing model folder instead of building one")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per phase (after one warm-up step)")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--workdir", type=Path, default=None, help="where the model and checkpoints go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be >= 1")
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
            "trainer": {"lr": 1e-5, "threads": a.threads, "warmup_steps": 0, "backend": backend, "skip_inert": False},
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

        def one_step() -> float:
            batch = make_batch(step_no[0], vocab, a.groups, a.group_size, a.prompt_len, a.response_len)
            sync_dev()
            t = time.perf_counter()
            trainer.train_step(batch)
            sync_dev()
            step_no[0] += 1
            return time.perf_counter() - t

        summary: dict[str, list[float]] = {}
        blocked: dict[str, float] = {}
        in_flight_steps: list[float] = []
        for phase in ("none", "sync", "async"):
            one_step()  # warm-up: first-touch costs, not timed
            ckpt_s = 0.0
            sealed: dict[str, Any] = {}
            sealer: threading.Thread | None = None
            path = str(work / f"ckpt-{phase}")
            shutil.rmtree(path, ignore_errors=True)
            if phase != "none":
                sync_dev()
                t = time.perf_counter()
                trainer.save_checkpoint(path, background=phase == "async")
                ckpt_s = time.perf_counter() - t
                if phase == "async":
                    def seal(path: str = path, sealed: dict[str, Any] = sealed) -> None:
                        try:
                            sealed["write_s"] = trainer.finish_checkpoint(path, trainer.checkpoint_timeout_s)
                        except BaseException as e:  # noqa: BLE001 - reported below, then raised
                            sealed["error"] = e
                        sealed["at"] = time.perf_counter()

                    sealer = threading.Thread(target=seal, name="seal", daemon=True)
                    sealer.start()
            times = []
            for i in range(a.steps):
                st = one_step()
                busy = sealer is not None and sealer.is_alive()
                times.append(st)
                if busy:
                    in_flight_steps.append(st)
                emit({"phase": phase, "step": i, "step_s": round(st, 4), "ckpt_s": round(ckpt_s if i == 0 else 0.0, 4),
                      "in_flight": busy})
            if sealer is not None:
                t = time.perf_counter()
                sealer.join(trainer.checkpoint_timeout_s + 60)
                if sealer.is_alive():
                    raise RuntimeError(f"the background checkpoint of {path} did not finish in time")
                if "error" in sealed:
                    raise RuntimeError(f"the background checkpoint of {path} failed: {sealed['error']}") from sealed["error"]
                tail_wait = time.perf_counter() - t
            if phase != "none" and not (Path(path) / "trainer.json").is_file():
                raise RuntimeError(f"{path}: the checkpoint is not complete (no trainer.json)")
            summary[phase] = times
            blocked[phase] = ckpt_s
            rec: dict[str, Any] = {"event": "phase", "phase": phase, "median_step_s": round(statistics.median(times), 4),
                                   "steps_s": [round(x, 4) for x in times], "ckpt_blocked_s": round(ckpt_s, 4)}
            if phase == "async":
                rec.update(write_s=round(sealed["write_s"], 3), waited_after_steps_s=round(tail_wait, 3))
            emit(rec)
        base = statistics.median(summary["none"])
        over = {"event": "overhead", "none_median_s": round(base, 4),
                "sync_blocked_s": round(blocked["sync"], 3),
                "async_blocked_s": round(blocked["async"], 3), "steps_with_write_in_flight": len(in_flight_steps)}
        if in_flight_steps:
            m = statistics.median(in_flight_steps)
            over.update(in_flight_median_s=round(m, 4), in_flight_overhead_pct=round(100 * (m / base - 1), 1))
        emit(over)
        trainer.close_checkpoints(60.0)
        shutil.rmtree(work / "ckpt-sync", ignore_errors=True)
        shutil.rmtree(work / "ckpt-async", ignore_errors=True)
    finally:
        dist.destroy_process_group()
        if out_f is not None:
            out_f.close()
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`flashrl doctor --gpu`: what can run on a GPU machine without vLLM, checked in one command.

    flashrl doctor --gpu            the checks on CUDA (nccl); on a machine without CUDA every check SKIPs
    flashrl doctor --device cpu     the same checks on the CPU (gloo): the check code itself, anywhere

Checks, one output line each (``PASS|FAIL|SKIP  name  detail``), exit code 1 on any FAIL, else 0:

    cuda              the device: torch's CUDA build, GPU count and names, bf16 support
    weights           flashrl/wire/weights.py on the device: a seeded state dict (float32 + bfloat16, one
                      tensor larger than a bucket) packed into buckets on the device; every bucket's
                      checksum (sum16 on a GPU, xxh3 on the CPU) equals the same algorithm's on a host
                      copy; unpacking gives back every tensor bit for bit; a changed element and two
                      swapped halves each change the checksum
    trainer[world N]  flashrl/trainer/worker.py's Trainer in N processes (N = 1, and 2 where two GPUs
                      exist; on the CPU both): FSDP2 (a GPU always shards: bf16 compute through FSDP2's
                      mixed precision, float32 master weights), two training steps of a small Qwen3 chat
                      model (loss finite, weights moved, version 2), logprobs finite
    pack[world N]     the trainer's own weight-sync packing (Trainer.prepare_weights: gather, pack,
                      checksums) of the trained weights: every bucket verifies, the names are the model's
    dcp[world N]      Trainer.save_checkpoint after step 1 (DCP, atomic rename), step 2, load_checkpoint:
                      the weights and version are step 1's again
    dcp-async[world N] the same state saved in the background (trainer.checkpoint_async: staged to host
                      buffers, written by DCP while step 2 trains, by the writer "auto" picks, sealed by
                      finish_checkpoint), loaded: step 1's weights exactly; then step 2's state by the other
                      writer (trainer.checkpoint_writer: a write thread, a writer process), loaded exactly
    broadcast         the weight sync's transport between two processes (nccl: needs two GPUs; gloo on
                      the CPU): trainer/weights.py's WeightSender (rank 0) -> a receiver joined with
                      wire/weights.py's join_group (rank 1) that verifies every bucket's checksum; the
                      detail gives the bytes per second

Each multi-process check runs in fresh child processes (``python -m flashrl.doctor worker ...``: the
same entry a torchrun would use), reporting JSON lines into a file (msgspec; never pickle); every
child has a deadline (``timeout_s``), past which it is killed and its check FAILs with its stderr tail.
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

__all__ = ["Check", "run_checks", "main"]

Status = Literal["PASS", "FAIL", "SKIP"]


class Check(msgspec.Struct):
    """One check's outcome: what the command prints as one line."""

    name: str
    status: Status
    detail: str = ""

    def line(self) -> str:
        return f"{self.status}  {self.name}  {self.detail}".rstrip()


class WorkerSpec(msgspec.Struct, kw_only=True):
    """What a doctor child process does (JSON in FLASHRL_DOCTOR_SPEC)."""

    job: Literal["trainer", "broadcast"]
    device: Literal["cuda", "cpu"]
    model: str = ""
    workdir: str
    report: str  # JSON lines of Check, appended by this process
    mib: float = 8.0  # broadcast: bytes to send


# ---------------------------------------------------------------------- in-process checks
def _device_check(device: str) -> Check:
    import torch

    if device == "cpu":
        return Check("cuda", "SKIP", "--device cpu: the checks run on the CPU with gloo")
    if not torch.cuda.is_available():
        why = "torch has no CUDA build" if torch.version.cuda is None else "no GPU visible (torch.cuda.is_available() is False)"
        return Check("cuda", "SKIP", f"{why}: no CUDA check can run here")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    bf16 = torch.cuda.is_bf16_supported()
    status: Status = "PASS" if bf16 else "FAIL"
    return Check("cuda", status, f"torch {torch.__version__} CUDA {torch.version.cuda}, {len(names)} GPU(s): "
                                 f"{', '.join(names)}; bf16 {'supported' if bf16 else 'NOT supported (the trainer computes in bf16)'}")


def seeded_state_dict(device: str, big_numel: int = 300_000, seed: int = 0) -> dict[str, Any]:
    """A state dict of float32 and bfloat16 tensors (one larger than a 1 MiB bucket), the same for a seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sd = {
        "model.embed_tokens.weight": torch.randn(big_numel, generator=g).reshape(-1, 100),
        "model.layers.0.mlp.weight": torch.randn(64, 48, generator=g),
        "model.layers.0.norm.weight": torch.randn(48, generator=g).to(torch.bfloat16),
        "model.layers.1.mlp.weight": torch.randn(512, 300, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(37, 11, generator=g),
    }
    return {k: v.to(device) for k, v in sd.items()}


def weights_check(device: str) -> Check:
    """flashrl/wire/weights.py's packing and checksums on ``device`` (module docstring: weights)."""
    import torch

    from flashrl.wire.weights import bucket_checksum, build_manifest, unpack_bucket, verify_checksum

    sd = seeded_state_dict(device)
    manifest, flats = build_manifest(sd, 1, bucket_mb=1.0, tie_word_embeddings=False)
    algo = "xxh3" if device == "cpu" else "sum16"
    problems = []
    if len(flats) < 3:
        problems.append(f"{len(flats)} buckets, expected >= 3 (two dtypes, one tensor over a bucket)")
    seen = []
    for b, flat in zip(manifest.buckets, flats):
        if flat.device.type != device:
            problems.append(f"a bucket on {flat.device}, not {device}")
        if not b.checksum.startswith(algo + ":"):
            problems.append(f"bucket checksum {b.checksum[:20]}... is not {algo}")
        host = bucket_checksum(flat.cpu(), algo)
        if host != b.checksum:
            problems.append(f"{algo} on {device} {b.checksum} != on the host {host}")
        if verify_checksum(flat, b.checksum) != b.checksum:
            problems.append("verify_checksum disagrees with build_manifest")
        for name, view in unpack_bucket(b, flat):
            seen.append(name)
            if not torch.equal(view, sd[name]):
                problems.append(f"{name} unpacked differs from the original")
        bad = flat.clone()
        bad[bad.numel() // 2] += 1
        if verify_checksum(bad, b.checksum) == b.checksum:
            problems.append("a changed element kept the checksum")
        half = flat.numel() // 2
        swapped = torch.cat([flat[half : 2 * half], flat[:half], flat[2 * half :]])
        if not torch.equal(swapped, flat) and verify_checksum(swapped, b.checksum) == b.checksum:
            problems.append("swapped halves kept the checksum")
    if sorted(seen) != sorted(sd):
        problems.append(f"the buckets hold {sorted(seen)}, not {sorted(sd)}")
    if problems:
        return Check("weights", "FAIL", "; ".join(dict.fromkeys(problems)))
    nbytes = sum(f.numel() * f.element_size() for f in flats)
    return Check("weights", "PASS", f"{len(flats)} buckets ({nbytes / 2**20:.1f} MiB) on {device}, {algo} checksums "
                                    "agree with the host's, unpack exact, corruption detected")


# ---------------------------------------------------------------------- child processes
def _report(spec: WorkerSpec, check: Check) -> None:
    with open(spec.report, "ab") as f:
        f.write(msgspec.json.encode(check) + b"\n")


def _trainer_cfg(device: str) -> Any:
    from flashrl.config import from_dict

    return from_dict({
        "model": {"dtype": "bfloat16" if device == "cuda" else "float32"},
        "trainer": {"lr": 1e-3, "threads": 1, "warmup_steps": 0, "backend": "nccl" if device == "cuda" else "gloo"},
        "algorithm": {"loss": "ppo"},
        "rollout": {"temperature": 0.7},
    })


def _batch(step: int) -> Any:
    """3 groups of 4 samples, two rewarded 1 and two 0 each: non-zero advantages, so the weights move."""
    from flashrl.wire.protocol import TrainBatch
    from flashrl.wire.trajectory import Trajectory

    samples = []
    for g in range(3):
        prompt = [5, 10 + g, 11, 12]
        for j, resp in enumerate(([20, 21, 22, 3], [30, 31, 3], [20, 21, 22, 3], [30, 31, 3])):
            n = len(resp)
            samples.append(Trajectory(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * n, behav_logp=[-3.0] * n,
                                       versions=[step] * n, reward=1.0 - j % 2, group=g, sample_id=f"{g}-{j}"))
    return TrainBatch(step=step, samples=samples)


_WRITE_TIMEOUT_S = 120.0  # a small model's background checkpoint write (the parent's deadline kills a hung child)


def _seal(trainer: Any, path: str, rank: int) -> None:
    """A background checkpoint's end, as a run ends it: rank 0 waits for every rank's write and seals it
    (finish_checkpoint); the other ranks wait for their own write."""
    if rank == 0:
        trainer.finish_checkpoint(path, _WRITE_TIMEOUT_S)
    else:
        trainer.wait_checkpoint_writes(_WRITE_TIMEOUT_S)


class _Run(msgspec.Struct, kw_only=True):
    """What the trainer checks saw on one rank: state dicts at each point, the steps' results, the failures of the
    background checkpoints (each check judges its part)."""

    before: dict[str, Any]
    saved: dict[str, Any]
    after: dict[str, Any]
    restored: dict[str, Any]
    restored_bg: dict[str, Any]
    restored_bg2: dict[str, Any]
    results: list[Any]
    step_s: float
    ckpt: str
    bg: str
    bg_error: str
    bg2_error: str
    first_writer: str
    other: str
    lp: list[float]
    manifest: Any
    prepared: Any


def _snapshot(trainer: Any) -> dict[str, Any]:
    return {k: v.clone() for k, v in trainer.full_state_dict().items()}  # a plain model's are live views


def _background_save(trainer: Any, path: str, rank: int, seal: bool, what: str) -> str:
    """Save ``path`` in the background (sealed now when ``seal``); "" or the failure, reported by dcp-async."""
    try:
        trainer.save_checkpoint(path, background=True)
        if seal:
            _seal(trainer, path, rank)
    except Exception as e:  # noqa: BLE001 - reported as dcp-async's FAIL; the other checks go on
        return f"{what}: {type(e).__name__}: {e}"
    return ""


def _exercise(trainer: Any, spec: WorkerSpec, rank: int) -> _Run:
    """Two steps, a checkpoint after the first (also in the background, written while the second trains), a
    background save by the other writer after the second, logprobs, the weight packing, then every load."""
    import torch.distributed as dist

    before = _snapshot(trainer)
    t0 = time.perf_counter()
    r1 = trainer.train_step(_batch(0))
    ckpt, bg = str(Path(spec.workdir) / "ckpt"), str(Path(spec.workdir) / "ckpt-bg")
    trainer.save_checkpoint(ckpt)
    saved = _snapshot(trainer)
    bg_error = _background_save(trainer, bg, rank, False, "background save")  # staged, written while step 2 trains
    r2 = trainer.train_step(_batch(1))
    step_s = time.perf_counter() - t0
    if not bg_error:
        try:
            _seal(trainer, bg, rank)
        except Exception as e:  # noqa: BLE001
            bg_error = f"background write: {type(e).__name__}: {e}"
    dist.barrier()  # rank 0 sealed (renamed) it before any rank loads it
    after = _snapshot(trainer)
    # the other background writer (trainer.checkpoint_writer: "auto" picked one above), on step 2's state
    first_writer = trainer.checkpoint_writer
    other = "process" if first_writer == "thread" else "thread"
    bg2 = str(Path(spec.workdir) / f"ckpt-bg-{other}")
    trainer.checkpoint_writer = other
    bg2_error = _background_save(trainer, bg2, rank, True, f"background save by the {other} writer")
    dist.barrier()
    lp = trainer.compute_logprobs([5, 10, 11, 12], [20, 21, 22, 3])
    manifest = trainer.prepare_weights(trainer.version)
    prepared = trainer.weights.prepared
    restored_bg2 = _loaded(trainer, bg2) if not bg2_error else {}
    restored_bg = _loaded(trainer, bg) if not bg_error else {}
    trainer.load_checkpoint(ckpt)
    return _Run(before=before, saved=saved, after=after, restored=trainer.full_state_dict(), restored_bg=restored_bg,
                restored_bg2=restored_bg2, results=[r1, r2], step_s=step_s, ckpt=ckpt, bg=bg, bg_error=bg_error,
                bg2_error=bg2_error, first_writer=first_writer, other=other, lp=lp, manifest=manifest,
                prepared=prepared)


def _loaded(trainer: Any, path: str) -> dict[str, Any]:
    trainer.load_checkpoint(path)
    return _snapshot(trainer)


def _trainer_job(spec: WorkerSpec, rank: int, world: int) -> None:
    """trainer / pack / dcp checks of one rank (every rank runs the same collectives; rank 0 reports)."""
    import torch
    import torch.distributed as dist

    from flashrl.trainer.worker import Trainer
    from flashrl.wire.rendezvous import init_default_group

    tag = f"[world {world}]"
    device = torch.device("cpu")
    if spec.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    init_default_group("nccl" if spec.device == "cuda" else "gloo", rank, world, datetime.timedelta(minutes=10))
    try:
        cfg = _trainer_cfg(spec.device)
        torch.manual_seed(0)
        trainer = Trainer(cfg, spec.model, device)
        run = _exercise(trainer, spec, rank)
        if rank != 0:
            return
        _report(spec, _trainer_check(trainer, run, spec, cfg, device, tag))
        _report(spec, _pack_check(trainer, run, tag))
        _report(spec, _dcp_check(trainer, run, device, tag))
        _report(spec, _dcp_async_check(run, device, tag))
    finally:
        dist.destroy_process_group()


def _trainer_check(trainer: Any, run: _Run, spec: WorkerSpec, cfg: Any, device: Any, tag: str) -> Check:
    import torch

    problems = []
    p = next(iter(trainer.model.parameters()))
    if p.device.type != spec.device:
        problems.append(f"parameters on {p.device}, not {spec.device}")
    if spec.device == "cuda" and not trainer.sharded:
        problems.append("a GPU trainer must be FSDP2-sharded (its bf16 mixed precision is FSDP2's)")
    losses = [r.metrics["loss/policy"] for r in run.results if r is not None]
    if len(losses) != 2 or not all(math.isfinite(x) for x in losses):
        problems.append(f"losses {losses}: expected two finite values")
    if not any(not torch.equal(run.before[k], run.after[k]) for k in run.before):
        problems.append("two steps left every weight unchanged")
    if not all(math.isfinite(x) for x in run.lp):
        problems.append(f"logprobs not finite: {run.lp}")
    detail = "; ".join(problems) or (
        f"2 steps on {device}, {'FSDP2' if trainer.sharded else 'plain module'}, "
        f"compute {cfg.model.dtype}, loss {losses[0]:.4f} -> {losses[1]:.4f}, {run.step_s:.1f}s")
    return Check(f"trainer{tag}", "FAIL" if problems else "PASS", detail)


def _pack_check(trainer: Any, run: _Run, tag: str) -> Check:
    """The trainer's own weight-sync packing: every bucket passes its checksum and unpacks to the state dict."""
    import torch

    from flashrl.wire.weights import unpack_bucket, verify_checksum

    manifest, problems = run.manifest, []
    if manifest is None or run.prepared is None:
        return Check(f"pack{tag}", "FAIL", "prepare_weights returned nothing on rank 0")
    names = []
    for b, flat in zip(manifest.buckets, run.prepared[1]):
        if verify_checksum(flat, b.checksum) != b.checksum:
            problems.append(f"bucket of {b.tensors[0].name} fails its own checksum")
        for name, view in unpack_bucket(b, flat):
            names.append(name)
            if not torch.equal(view.cpu(), run.after[name].to(view.dtype).cpu()):
                problems.append(f"{name} packed differs from the state dict")
    want = [k for k in run.after if not (trainer.tie_word_embeddings and k == "lm_head.weight")]
    if sorted(names) != sorted(want):
        problems.append(f"packed names {sorted(set(want) ^ set(names))} differ from the model's")
    algos = sorted({b.checksum.split(":")[0] for b in manifest.buckets})
    return Check(f"pack{tag}", "FAIL" if problems else "PASS", "; ".join(dict.fromkeys(problems)) or
                 f"{len(manifest.buckets)} buckets, {'/'.join(algos)} verified, "
                 f"gather {manifest.timings.get('gather_s', 0):.3f}s pack {manifest.timings.get('pack_s', 0):.3f}s")


def _dcp_check(trainer: Any, run: _Run, device: Any, tag: str) -> Check:
    import torch

    problems = []
    if not Path(run.ckpt).is_dir() or Path(run.ckpt + ".tmp").exists():
        problems.append(f"{run.ckpt} not renamed into place")
    if trainer.version != 1:
        problems.append(f"version {trainer.version} after loading step 1's checkpoint")
    changed = [k for k in run.saved if not torch.equal(run.saved[k], run.restored[k])]
    if changed:
        problems.append(f"{len(changed)} tensors differ from the saved ones after load (e.g. {changed[0]})")
    if not any(not torch.equal(run.saved[k], run.after[k]) for k in run.saved):
        problems.append("step 2 changed nothing, so the load proved nothing")
    return Check(f"dcp{tag}", "FAIL" if problems else "PASS", "; ".join(problems) or
                 f"save (atomic), step, load on {device}: weights and version restored exactly")


def _dcp_async_check(run: _Run, device: Any, tag: str) -> Check:
    """The background checkpoint of step 1, written while step 2 trained, and the other writer's of step 2."""
    import torch

    problems = [run.bg_error] if run.bg_error else []
    if not run.bg_error:
        if not Path(run.bg).is_dir() or Path(run.bg + ".tmp").exists():
            problems.append(f"{run.bg} not sealed (renamed into place)")
        changed = [k for k in run.saved if not torch.equal(run.saved[k], run.restored_bg[k])]
        if changed:
            problems.append(f"{len(changed)} tensors differ from step 1's after load (e.g. {changed[0]}): the "
                            "write saw the step trained beside it")
    if run.bg2_error:
        problems.append(run.bg2_error)
    else:
        changed = [k for k in run.after if not torch.equal(run.after[k], run.restored_bg2[k])]
        if changed:
            problems.append(f"the {run.other} writer's checkpoint: {len(changed)} tensors differ from step 2's after "
                            f"load (e.g. {changed[0]})")
    return Check(f"dcp-async{tag}", "FAIL" if problems else "PASS", "; ".join(problems) or
                 f"background save by the {run.first_writer} writer (staged, written while step 2 trained), "
                 f"sealed, load on {device}: step 1's weights restored exactly; by the {run.other} writer: "
                 "step 2's restored exactly")


def _broadcast_job(spec: WorkerSpec, rank: int) -> None:
    """Rank 0 sends with WeightSender; rank 1 joins with join_group, receives and verifies each bucket."""
    import torch

    from flashrl.trainer.weights import WeightSender
    from flashrl.wire.weights import build_manifest, join_group, verify_checksum

    backend = "nccl" if spec.device == "cuda" else "gloo"
    device = "cpu"
    if spec.device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    numel = max(1000, int(spec.mib * 2**20 / 4))
    # both ranks build the same seeded state dict: rank 1 knows the manifest it must receive
    sd = seeded_state_dict(device, big_numel=numel - numel % 100)
    manifest, flats = build_manifest(sd, 1, bucket_mb=64.0, tie_word_embeddings=False)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    nbytes = sum(f.numel() * f.element_size() for f in flats)
    if rank == 0:
        sender = WeightSender()
        sender.join("doctor", addr, port, backend, 300.0)
        seconds, failed = sender.send(flats)
        sender.close()
        if failed:
            _report(spec, Check("broadcast", "FAIL", f"sender: {failed}"))
        return
    group = join_group(addr, port, 1, 2, backend, 300.0)
    from flashrl.wire.weights import DTYPES

    problems = []
    t0 = time.perf_counter()
    received = []
    for b in manifest.buckets:
        buf = torch.zeros(b.numel, dtype=DTYPES[b.dtype], device=device)
        group.broadcast(buf, 0).wait()  # type: ignore[union-attr]  # bound in C++, not in torch stubs
        received.append(buf)
    if spec.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    for b, buf in zip(manifest.buckets, received):
        if verify_checksum(buf, b.checksum) != b.checksum:
            problems.append(f"bucket of {b.tensors[0].name} arrived with another checksum")
    _report(spec, Check("broadcast", "FAIL" if problems else "PASS", "; ".join(problems) or
                        f"{backend}: {len(received)} buckets, {nbytes / 2**20:.0f} MiB in {seconds:.3f}s "
                        f"({nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s), every checksum verified on {device}"))


def worker_main(argv: list[str]) -> int:
    """``python -m flashrl.doctor worker RANK WORLD`` (spec in FLASHRL_DOCTOR_SPEC, torchrun's variables set)."""
    spec = msgspec.json.decode(os.environ["FLASHRL_DOCTOR_SPEC"], type=WorkerSpec)
    rank, world = int(argv[0]), int(argv[1])
    if spec.job == "trainer":
        _trainer_job(spec, rank, world)
    else:
        _broadcast_job(spec, rank)
    return 0


def _spawn(spec: WorkerSpec, world: int, names: list[str], timeout_s: float) -> list[Check]:
    """Run ``world`` children of ``spec`` to completion (or the deadline); their reported checks, and a
    FAIL for each expected name (``names``) no child reported."""
    from flashrl.wire.transport import free_port

    Path(spec.report).unlink(missing_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "FLASHRL_DOCTOR_SPEC": msgspec.json.encode(spec).decode(), "OMP_NUM_THREADS": "1"}
    procs = []
    logs = []
    for rank in range(world):
        log = open(Path(spec.workdir) / f"{spec.job}-{world}-rank{rank}.log", "w+b")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "flashrl.doctor", "worker", str(rank), str(world)],
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                q.kill()
            for q in procs:
                q.wait()
            break
    found = []
    if Path(spec.report).exists():
        for line in Path(spec.report).read_bytes().splitlines():
            found.append(msgspec.json.decode(line, type=Check))
    tail = ""
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        text = log.read().decode(errors="replace")
        log.close()
        if p.returncode != 0 or timed_out:
            lines = [ln for ln in text.strip().splitlines() if ln.strip()]
            tail += f" | rank {rank} exit {p.returncode}: {' / '.join(lines[-3:])[-600:]}"
    why = (f"timed out after {timeout_s:.0f}s (--timeout)" if timed_out else "not reported") + tail
    have = {c.name for c in found}
    out = [Check(c.name, "FAIL", c.detail + tail) if c.status == "PASS" and tail else c for c in found]
    return out + [Check(n, "FAIL", why) for n in names if n not in have]


# ---------------------------------------------------------------------- the command
def run_checks(device: Literal["cuda", "cpu"], timeout_s: float = 600.0, workdir: str | None = None,
               on_check: Callable[[Check], None] | None = None, worlds: tuple[int, ...] = (1, 2)) -> list[Check]:
    """Every check of the module docstring on ``device``; a CUDA request without CUDA SKIPs them all.

    ``worlds``: the trainer world sizes to check (a test runs (1,) to stay short)."""
    results: list[Check] = []

    def emit(checks: Iterator[Check] | list[Check]) -> None:
        for c in checks:
            results.append(c)
            if on_check is not None:
                on_check(c)

    first = _device_check(device)
    emit([first])
    names = ["weights", *(f"{c}[world {w}]" for w in worlds for c in ("trainer", "pack", "dcp", "dcp-async")),
             "broadcast"]
    if device == "cuda" and first.status != "PASS":
        why = "CUDA is not usable here (see the cuda line)" if first.status == "FAIL" else "no CUDA device"
        emit([Check(n, "SKIP", why) for n in names])
        return results
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    two = device == "cpu" or gpus >= 2
    not_two = f"needs 2 GPUs, this machine has {gpus}"
    try:
        emit([weights_check(device)])
    except Exception as e:  # noqa: BLE001 - a crashing check is that check's FAIL, the others still run
        emit([Check("weights", "FAIL", f"{type(e).__name__}: {e}")])
    with tempfile.TemporaryDirectory(prefix="flashrl-doctor-", dir=workdir) as tmp:
        from flashrl.models.chat_model import build_chat_model

        model = str(build_chat_model(Path(tmp) / "model", size="tiny"))
        for world in worlds:
            tag = f"[world {world}]"
            group = [f"trainer{tag}", f"pack{tag}", f"dcp{tag}", f"dcp-async{tag}"]
            if world == 2 and not two:
                emit([Check(n, "SKIP", not_two) for n in group])
                continue
            wd = Path(tmp) / f"trainer{world}"
            wd.mkdir()
            spec = WorkerSpec(job="trainer", device=device, model=model, workdir=str(wd), report=str(wd / "report.jsonl"))
            emit(_spawn(spec, world, group, timeout_s))
        if not two:
            emit([Check("broadcast", "SKIP", f"nccl between two processes {not_two}")])
        else:
            wd = Path(tmp) / "broadcast"
            wd.mkdir()
            spec = WorkerSpec(job="broadcast", device=device, workdir=str(wd), report=str(wd / "report.jsonl"),
                              mib=256.0 if device == "cuda" else 8.0)
            emit(_spawn(spec, 2, ["broadcast"], timeout_s))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker_main(argv[1:])
    print("usage: flashrl doctor [--gpu] [--device cuda|cpu]  (this module's children: python -m flashrl.doctor worker RANK WORLD)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

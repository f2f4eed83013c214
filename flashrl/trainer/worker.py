"""One trainer rank: an FSDP2-sharded Hugging Face causal LM, driven by the controller through rank 0.

    controller --TrainerRequest (ZeroMQ)--> rank 0 RpcServer (asyncio, main thread)
                                              | Ping: answered at once (Pong(version)), never queued
                                              | SendWeights: on the send thread, beside the compute thread
                                              | FinishCheckpoint: on the seal thread (waits for a background
                                              |   checkpoint write, then renames it into place)
                                              | anything else: one at a time (lock), on the compute thread
                                              v
        rank 0 compute thread: broadcast(msgspec bytes as a uint8 tensor) ---> ranks 1..R-1 (main thread)
                               Trainer.execute(msg)  <-- same collectives, same order -->  Trainer.execute(msg)
                                              |
    controller <--TrainerReply-- rank 0 (only rank 0's result is sent back)

Every rank runs the same request through ``Trainer.execute``, so the collectives inside (FSDP
all-gathers and reduce-scatters, metric reductions, state-dict gathers, DCP saves) line up by
construction. Requests only rank 0 acts on (Ping, InitWeightSync, SendWeights, FinishCheckpoint) are not
broadcast. A background checkpoint (SaveCheckpoint with ``background``) is staged by every rank on the
compute thread, then written by each rank's write thread over a gloo group of its own (``save_checkpoint``).
While idle, rank 0 broadcasts a Ping every ``KEEPALIVE_S`` so the other ranks' pending receive never
hits the process-group timeout during a long rollout phase. Ranks 1.. poll that receive (async_op +
short sleeps) instead of blocking in C++, so SIGTERM is handled at once. Rank 0's RPC server and
keepalive are watched as the engine server watches its own (``aio.until_stopped``): one that ends
before a stop exits rank 0 at once (code 1, the task and its error in its log), and the controller
sees the trainer die.

The process group backend is ``trainer.backend`` (auto: nccl with CUDA, else gloo); the same code
runs both. On CPU the weights are float32; on GPU a non-float32 ``model.dtype`` becomes FSDP2's
compute dtype (MixedPrecisionPolicy) with float32 master weights and gradient reduction.

Entry point (exactly the env vars torchrun sets, so torchrun can launch it on a cluster, plus the
rank's ``TrainerSpec`` as JSON: trainer/spec.py, flashrl/wire/spec.py)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 LOCAL_RANK=0 \\
        FLASHRL_SPEC='{"cfg": {...}, "address": "tcp://127.0.0.1:5555", "model": "PATH"}' python -m flashrl.trainer.worker

The training step itself (phases, metrics) is ``flashrl.trainer.step.PolicyTrainer``, a plain class
that needs no process group; ``Trainer`` here is that class plus the process shell: the model built
(FSDP2-sharded with more than one rank), collectives over the default group, checkpoints, the weight
sync's sending end, and the request fan-out above.

Limits: an error raised on every rank before any collective (a malformed batch) is a per-request
Error; an error on one rank in the middle of collectives leaves the others waiting until the process
group times out, and the client sees a dead rank. The critic replicas stay identical only if their
kernels are deterministic (true on the CPU; on GPUs they may drift apart by rounding, harmlessly).
Credit switches the policy (FSDP2-wrapped) to eager attention for its forward; HF returns every
layer's L x L maps at once, so that forward runs ``trainer.micro_batch`` samples at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from flashrl.aio import TaskDied, until_stopped
from flashrl.checkpoint import fsync_dir
from flashrl.config import Config
from flashrl.deadlines import checkpoint_timeout_s, model_params
from flashrl.procs import child_init, exit_now, paused_gc
from flashrl.trainer.spec import TrainerSpec
from flashrl.trainer.step import Collectives, PolicyTrainer, plan_micro_batches
from flashrl.wire import protocol
from flashrl.wire.protocol import (
    CheckpointSaved,
    ComputeLogprobs,
    Error,
    FinishCheckpoint,
    InitWeightSync,
    Logprobs,
    Msg,
    Ok,
    Ping,
    Pong,
    PrepareWeights,
    SaveCheckpoint,
    SaveModel,
    SendWeights,
    Shutdown,
    TrainStep,
    WeightManifest,
)
from flashrl.wire.rendezvous import init_default_group
from flashrl.wire.spec import read_spec_or_exit

__all__ = ["Trainer", "ProcessCollectives", "plan_micro_batches"]

log = logging.getLogger("flashrl.trainer")

KEEPALIVE_S = 60.0  # idle broadcast period; far below the process group's 30 min default timeout
_RANK0_ONLY = (Ping, InitWeightSync, SendWeights, FinishCheckpoint)
CHECKPOINT_META = "trainer.json"


def resolve_backend(backend: str) -> str:
    """``trainer.backend``: auto -> nccl when CUDA is available, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("trainer.backend = nccl but CUDA is not available here; use auto or gloo")
    return backend


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks to shard one by one: the classes HF marks as not splittable (Qwen2DecoderLayer, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(f"{type(model).__name__}: no decoder layers found (_no_split_modules={sorted(names)}); "
                           "FSDP2 needs the per-layer blocks to shard")
    return layers


class ProcessCollectives(Collectives):
    """The step's reductions over the default process group (every rank calls them in the same order)."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)


def build_policy(model_path: str, mesh: Any, mp: Any, shard: bool, lora: Any = None) -> torch.nn.Module:
    """The HF model at ``model_path`` in float32 (master weights), FSDP2-sharded per decoder layer if ``shard``.
    ``lora`` (trainer/lora.py LoraSpec): wrapped with peft adapters first, only they train."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    base = m
    if lora is not None:
        from flashrl.trainer.lora import apply_lora

        m = apply_lora(base, lora)
    if shard:
        for layer in _decoder_layers(base):
            fully_shard(layer, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        fully_shard(m, mesh=mesh, **({"mp_policy": mp} if mp else {}))
    # No dropout in RL updates: the proximal logprobs must be what the update then differentiates.
    m.train(False)
    return m


class Trainer(PolicyTrainer):
    """One rank: the training step (PolicyTrainer) plus what needs the process group.

    Needs an initialized default process group. ``execute`` must be called on every rank with the same
    message in the same order; it returns the reply on rank 0 (None elsewhere, and None for requests
    rank 0 answers without a reply).

    Every rank holds an FSDP2-sharded model; one rank alone holds the plain module (see ``sharded``
    below), and its metric reductions and request fan-out are skipped (nothing to reduce or send).
    """

    def __init__(self, cfg: Config, model_path: str, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.model_path = model_path
        comm = ProcessCollectives()
        mp = None
        if device.type == "cuda" and cfg.model.dtype != "float32":
            compute = getattr(torch, cfg.model.dtype)
            mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        # One rank alone holds a plain module (no FSDP hooks, all-gathers or DTensors: the same step, less
        # fixed cost); FSDP2 with more ranks, or for a GPU mixed-precision policy (FSDP2 applies it).
        # DCP checkpoints load across the two (tests/integration/test_resume.py resumes at another world size).
        self.sharded = comm.world > 1 or mp is not None
        mesh = init_device_mesh(device.type, (comm.world,)) if self.sharded else None
        self.lora = None
        if cfg.model.lora.rank:
            from flashrl.trainer.lora import LoraSpec

            lo = cfg.model.lora
            self.lora = LoraSpec(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, target_modules=tuple(lo.target_modules))

        def build() -> torch.nn.Module:
            m = build_policy(model_path, mesh, mp, self.sharded, self.lora)
            return m if self.sharded else m.to(device)  # fully_shard places a sharded model on the mesh's device

        model = build()
        ref_model = None
        if cfg.algorithm.kl_coef > 0:
            ref_model = build()  # the initial weights, frozen: the KL anchor
            ref_model.requires_grad_(False)
        super().__init__(cfg, model, device, ref_model=ref_model, comm=comm)
        self._prepared: tuple[int, list[torch.Tensor]] | None = None
        # The last version sent (its buckets kept for a restarted engine's catch-up: one host copy of
        # the weights; on a GPU trainer that is GPU memory, see docs/failures.md).
        self._published: tuple[int, list[torch.Tensor]] | None = None
        self._sender: Any = None
        # Versions whose first send (the publication) is in flight on rank 0's send thread (leader_loop):
        # a PrepareWeights meanwhile is refused (check_prepare). Claimed and released on one thread only.
        self._publishing: set[int] = set()
        # Background checkpoint writes by path (save_checkpoint(background=True)); the compute thread adds,
        # rank 0's finish thread (finish_checkpoint) removes: hence the lock.
        self._writes: dict[str, _Write] = {}
        self._writes_lock = threading.Lock()
        self._ckpt_group: Any = None
        self._stager: Any = None
        params = model_params(model_path)
        self.checkpoint_writer = checkpoint_writer(cfg.trainer.checkpoint_writer, params)
        self._write_pool: ThreadPoolExecutor | None = None
        self.checkpoint_timeout_s = checkpoint_timeout_s(cfg, params)

    # ------------------------------------------------------------------ dispatch
    def execute(self, msg: Msg) -> Msg | None:
        if isinstance(msg, TrainStep):
            return self.train_step(msg.batch)
        if isinstance(msg, PrepareWeights):
            return self.prepare_weights(msg.version)
        if isinstance(msg, SendWeights):
            return self.send_weights(msg.version, msg.peers)
        if isinstance(msg, InitWeightSync):
            return self.init_weight_sync(msg)
        if isinstance(msg, ComputeLogprobs):
            lp = self.compute_logprobs(msg.prompt_ids, msg.response_ids, msg.temperature)
            return Logprobs(logprobs=lp) if self.rank == 0 else None
        if isinstance(msg, SaveCheckpoint):
            waited = self.save_checkpoint(msg.path, msg.background)
            return CheckpointSaved(path=msg.path, wait_s=waited)
        if isinstance(msg, FinishCheckpoint):
            return CheckpointSaved(path=msg.path, write_s=self.finish_checkpoint(msg.path, msg.timeout_s))
        if isinstance(msg, SaveModel):
            self.save_model(msg.path, msg.replace)
            return Ok(info=msg.path) if self.rank == 0 else None
        if isinstance(msg, Ping):
            return Pong(version=self.version)
        if isinstance(msg, Shutdown):
            # a write in flight ends first (bounded); nothing unsealed becomes a checkpoint
            self.close_checkpoints(self.checkpoint_timeout_s)
            return Ok(info="shutdown")
        raise ValueError(f"trainer: no handler for {type(msg).__name__}")

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank must call this; rank 0 gets the full CPU state dict, the others an empty one.

        A plain (unsharded) CPU model's state dict is its own tensors, detached: no gather, no copy
        (callers copy what they keep: build_manifest packs into new buckets, save_hf_folder writes)."""
        if not self.sharded and self.device.type == "cpu":
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # a model's state dict holds tensors only (torch types it as any state-dict value)
        return cast(dict[str, torch.Tensor],
                    get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))

    def prepare_weights(self, version: int) -> WeightManifest | None:
        t0 = time.perf_counter()
        sd = self.full_state_dict()
        if self.rank != 0:
            return None
        from flashrl.wire.weights import build_manifest

        t1 = time.perf_counter()
        self._prepared = None  # free the previous version's buckets before building new ones
        tied = self.tie_word_embeddings
        if self.lora is not None:  # LoRA: only the adapter's tensors travel (engine/lora.py loads them)
            from flashrl.trainer.lora import adapter_from_state_dict

            sd, tied = adapter_from_state_dict(sd), False
        manifest, buckets = build_manifest(sd, version, self.cfg.weight_sync.bucket_mb, tie_word_embeddings=tied)
        self._prepared = (version, buckets)
        manifest.timings = {"gather_s": t1 - t0, "pack_s": time.perf_counter() - t1}
        return manifest

    def send_weights(self, version: int, peers: list[str] | None = None) -> Ok:
        """Send ``version`` to ``peers`` (None: every joined engine): the version just prepared
        (it then becomes the published one) or the published one again (a restarted engine catching up)."""
        claim = self.claim_send(version)
        try:
            return self.finish_send(claim, peers)
        finally:
            self.release_send(claim)

    def claim_send(self, version: int) -> tuple[int, list[torch.Tensor], bool]:
        """Take the buckets of ``version`` for a send: (version, buckets, is a publication).

        Rank 0's leader_loop claims on its event-loop thread, in request order, then sends on its own
        send thread beside the compute thread (a TrainStep runs meanwhile); the claim holds its own
        reference to the buckets, which nothing writes after build_manifest made them (new tensors), so
        a later PrepareWeights cannot change what is being sent."""
        if self._sender is None:
            raise RuntimeError("SendWeights before InitWeightSync: initialize the weight-sync group first")
        if self._prepared is not None and self._prepared[0] == version:
            buckets = self._prepared[1]
            self._published, self._prepared = self._prepared, None
            self._publishing.add(version)
            return version, buckets, True
        if self._published is not None and self._published[0] == version:
            return version, self._published[1], False
        have = [v[0] for v in (self._prepared, self._published) if v is not None]
        raise RuntimeError(f"SendWeights({version}): prepared/published versions are {have}; "
                           f"send PrepareWeights({version}) first")

    def finish_send(self, claim: tuple[int, list[torch.Tensor], bool], peers: list[str] | None) -> Ok:
        """The broadcast of a claimed version (any thread; the per-engine weight-sync groups only, never
        the default process group)."""
        version, buckets, _ = claim
        seconds, failed = self._sender.send(buckets, peers)
        info = f"sent version {version} in {seconds:.3f}s"
        if failed:
            info += "; failed: " + "; ".join(f"{p}: {e}" for p, e in sorted(failed.items()))
        return Ok(info=info)

    def release_send(self, claim: tuple[int, list[torch.Tensor], bool]) -> None:
        if claim[2]:
            self._publishing.discard(claim[0])

    def check_prepare(self, version: int) -> None:
        """Refuse PrepareWeights(``version``) while a publication is still sending (on rank 0, before the
        request fans out, so no rank starts the gather). The controller awaits a sync before preparing
        the next; this is the loud error should it ever not."""
        if self._publishing:
            raise RuntimeError(f"PrepareWeights({version}) while SendWeights({min(self._publishing)}) is still "
                               "sending: the previous weight sync must finish before the next is prepared")

    def init_weight_sync(self, msg: InitWeightSync) -> Ok:
        """Join one engine's group (``msg.peer``); may run beside a training step (rank 0's sync thread)."""
        from flashrl.trainer.weights import WeightSender

        if msg.world_size != 2:
            raise ValueError(f"weight sync: one group of two per engine (trainer rank 0 + the engine); got world_size "
                             f"{msg.world_size}")
        if self._sender is None:
            self._sender = WeightSender()
        self._sender.join(msg.peer or "engine", msg.master_addr, msg.master_port, msg.backend, msg.timeout_s)
        return Ok(info=f"weight sync: {msg.peer or 'engine'} joined ({msg.backend})")

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, path: str, replace: bool = False) -> None:
        """The current policy as a Hugging Face folder at ``path`` (every rank gathers; rank 0 writes it,
        atomically, in model.dtype, with the run model's config, tokenizer and generation config)."""
        sd = self.full_state_dict()
        err: Exception | None = None
        if self.rank == 0:
            from flashrl.trainer.hf import save_hf_folder

            try:
                if self.lora is not None:  # LoRA: the merged model, its adapter (peft) in <path>/adapter
                    from flashrl.trainer.lora import save_merged

                    save_merged(sd, self.lora, self.model_path, path, dtype=self.cfg.model.dtype, replace=replace)
                else:
                    save_hf_folder(sd, self.model_path, path, dtype=self.cfg.model.dtype, replace=replace)
            except Exception as e:  # raised after the barrier: the other ranks must not wait on rank 0
                err = e
        dist.barrier()
        if err is not None:
            raise err

    def save_checkpoint(self, path: str, background: bool = False) -> float:
        """DCP save of model + optimizer (+ critics, torch RNG) into ``path``, atomically: write ``path.tmp``, fsync, rename.

        ``path`` must be on a file system every rank sees. An existing ``path`` is refused (checkpoints
        are never overwritten in place); a leftover ``path.tmp`` from a crash is removed first.

        ``background`` (trainer.checkpoint_async): the state is copied into host staging buffers (DCP's
        ``_checkpoint_stager``, kept between checkpoints: one more host copy of the training state) and this
        returns; ``dcp.save`` writes ``path.tmp`` at the lowest CPU priority, over a gloo group of its own
        (its collectives never interleave with the step's), while training goes on: in a writer process
        (``checkpoint_writer`` "process": DCP's process-based async save of buffers in shared memory, so
        the write's Python work never takes this interpreter's lock) or on a write thread ("thread"). ``path`` does not exist until rank 0's
        ``finish_checkpoint(path)`` has seen the write complete on every rank and renamed it: a crash
        meanwhile leaves only ``path.tmp``. A save while another is in flight first waits for that
        write. Returns the seconds waited for it.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        waited = self.wait_checkpoint_writes(self.checkpoint_timeout_s)
        final, tmp = Path(path), Path(path + ".tmp")
        err = ""
        if self.rank == 0:
            if final.exists():
                err = f"checkpoint {final} already exists; choose a new path or delete it"
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.parent.mkdir(parents=True, exist_ok=True)
        if self._agree_error(err):
            raise FileExistsError(err or f"checkpoint {final} refused by rank 0")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if self.lora is not None:  # adapter-only: the frozen base is the model folder's (trainer/lora.py)
            from flashrl.trainer.lora import adapter_entries

            model_sd = adapter_entries(model_sd)
        # torch's RNG (replicated: one copy); nothing in a step samples today, but a dropout or a sampled
        # credit would, and a resumed run must then draw what the uninterrupted one would have
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "rng": torch.get_rng_state()}
        if self.critics is not None:
            # replicated plain tensors: DCP writes one copy
            state["critics"], state["critics_optim"] = get_state_dict(self.critics, self.critics.optimizer)
        meta = {"version": self.version, "world_size": self.world, "critics": self.critics is not None, "rng": True,
                "adapter_only": self.lora is not None}
        if not background:
            dcp.save(state, checkpoint_id=str(tmp))
            if self.rank == 0:
                _seal_checkpoint(tmp, final, meta)
            dist.barrier()
            return waited
        # Staged synchronously (the copy is done when stage() returns: the next step may change the weights at
        # once), then DCP's own save (what dcp.async_save runs on its thread) on this trainer's write thread,
        # which runs at the lowest CPU priority: where cores are short (a CPU trainer) the step goes first.
        staged = self._checkpoint_stager().stage(state)
        group = self._checkpoint_group()
        if self._write_pool is None:
            self._write_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write",
                                                  initializer=_lowest_priority)
        future = self._write_pool.submit(_write_staged, staged, str(tmp), group, self.checkpoint_writer == "process")
        with self._writes_lock:
            self._writes[path] = _Write(path=path, future=future, meta=meta)
        return waited

    def finish_checkpoint(self, path: str, timeout_s: float) -> float:
        """Rank 0, off the compute thread: wait (at most ``timeout_s``) for the background write of
        ``path`` (``save_checkpoint(path, background=True)``) and seal it: trainer.json, fsync, rename
        ``path.tmp`` -> ``path``. Rank 0's DCP save returns only after every rank's write results reached
        it (DCP's final gather), so its completion means the whole checkpoint is on disk. Returns the
        seconds the write took in all. A failed or late write raises and ``path`` never appears."""
        with self._writes_lock:
            w = self._writes.get(path)
        if w is None:
            raise RuntimeError(f"no checkpoint write of {path} in flight (never started, or superseded by a later "
                               "save); the checkpoint was not written")
        try:
            w.future.result(timeout=timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"checkpoint write of {path} not done after {timeout_s:.0f} s (the file system is "
                               "slow or stuck); raise trainer.checkpoint_timeout_s") from None
        finally:
            if w.future.done():
                with self._writes_lock:
                    self._writes.pop(path, None)
        _seal_checkpoint(Path(path + ".tmp"), Path(path), w.meta)
        return time.monotonic() - w.started

    def wait_checkpoint_writes(self, timeout_s: float) -> float:
        """Wait (at most ``timeout_s``) for every background write of this rank; the seconds waited.

        A write that failed or is late is logged and forgotten (its ``path.tmp`` is never renamed into a
        checkpoint); rank 0 forgets a finished write nobody sealed (its ``finish_checkpoint`` never came)."""
        with self._writes_lock:
            writes = list(self._writes.values())
            self._writes.clear()
        t0 = time.monotonic()
        for w in writes:
            left = max(0.0, timeout_s - (time.monotonic() - t0))
            try:
                w.future.result(timeout=left)
            except FutureTimeout:
                log.error("checkpoint write of %s not done after %.0f s: abandoned (not a checkpoint)", w.path, timeout_s)
            except Exception as e:  # noqa: BLE001 - the write's own error; the checkpoint is simply not there
                log.error("checkpoint write of %s failed: %s (not a checkpoint)", w.path, e)
            else:
                if self.rank == 0:
                    log.warning("checkpoint write of %s finished but was never sealed: left as %s.tmp", w.path, w.path)
        return time.monotonic() - t0 if writes else 0.0

    def _checkpoint_group(self) -> Any:
        """A gloo group for background DCP writes: the write thread's collectives then never interleave
        with the compute thread's on the default group (and async_save needs a CPU backend under NCCL).
        Made on the first background save, which every rank runs in the same request order."""
        if self._ckpt_group is None:
            self._ckpt_group = dist.new_group(backend="gloo")
        return self._ckpt_group

    def _checkpoint_stager(self) -> Any:
        """A synchronous DCP stager kept for the run, reusing its host buffers from one checkpoint to the
        next (no fresh allocation and page faults per checkpoint).

        On CUDA: DCP's BlockingAsyncStager with its cache (pinned host buffers, built by torch's
        ``_create_cpu_state_dict``, which knows FSDP2's DTensors): DefaultStager's deep copy raised
        ``KeyError: <class 'type'>`` on FSDP2's DTensors under torch 2.11 on an H200
        (bench/results/realsize/README.md). On the CPU: DefaultStager (no pinning), its buffers in shared
        memory for a writer process (which then maps them: nothing is copied to it), measured here."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            if self.device.type == "cuda":
                self._stager = BlockingAsyncStager(cache_staged_state_dict=True)
                return self._stager
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            except ImportError:  # an older torch: its blocking stager, uncached on the CPU (no pinning there)
                self._stager = BlockingAsyncStager(cache_staged_state_dict=False)
            else:
                # shared memory only for a writer process (a container's /dev/shm may be small); should the
                # writer change later (doctor's dcp-async does), torch moves a buffer into shared memory as
                # it sends it, once: the buffers are kept
                self._stager = DefaultStager(StagingOptions(
                    use_pinned_memory=False, use_shared_memory=self.checkpoint_writer == "process",
                    use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def close_checkpoints(self, timeout_s: float) -> None:
        """At shutdown: wait (at most ``timeout_s``) for the writes in flight, then free the staging buffers.
        Nothing is sealed here: only ``finish_checkpoint`` makes a checkpoint (so a half write never counts)."""
        self.wait_checkpoint_writes(timeout_s)
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._write_pool is not None:
            self._write_pool.shutdown(wait=False)
            self._write_pool = None

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, critics (asyppo) and version from a ``save_checkpoint`` folder (any
        world size). Critics missing from the checkpoint (it was not an asyppo run) start fresh."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        meta = json.loads((Path(path) / CHECKPOINT_META).read_text())
        adapter_only = bool(meta.get("adapter_only"))
        if adapter_only and self.lora is None:
            raise ValueError(f"checkpoint {path} holds a LoRA adapter only, and this run trains the full model: resume "
                             "it with the checkpoint's model.lora settings")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if adapter_only:  # the base weights stay the model folder's, loaded at build
            from flashrl.trainer.lora import adapter_entries

            model_sd = adapter_entries(model_sd)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if meta.get("rng"):
            state["rng"] = torch.get_rng_state()
        critics = self.critics is not None and bool(meta.get("critics", False))
        if self.critics is not None:
            if critics:
                state["critics"], state["critics_optim"] = get_state_dict(self.critics, self.critics.optimizer)
            else:
                log.warning("checkpoint %s holds no critics (not an asyppo run): the critics start fresh", path)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=not adapter_only))
        if critics and self.critics is not None:
            set_state_dict(self.critics, self.critics.optimizer, model_state_dict=state["critics"],
                           optim_state_dict=state["critics_optim"])
        if "rng" in state:
            torch.set_rng_state(state["rng"])
        self.version = int(meta["version"])

    def _agree_error(self, err: str) -> bool:
        """Broadcast whether rank 0 found an error, so every rank skips the collectives together."""
        flag = torch.tensor([1 if err else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())


# "auto" picks the writer process from this many float32 weight bytes: at 0.27B (1 GiB of weights, a 3.2 GB
# checkpoint) a write thread cost the step beside it +24% and the process +13% on a 2-core CPU, and on an H200
# +171% against +45% (bench/results/realsize); at the built-in model's 6 MB a write takes milliseconds, less
# than starting the process (torch's import: 2-3 s of a core, ~0.3 GiB) would cost the run.
PROCESS_WRITER_MIN_BYTES = 256 << 20


def checkpoint_writer(setting: str, params: int) -> str:
    """trainer.checkpoint_writer resolved: "auto" is "process" for a model of at least PROCESS_WRITER_MIN_BYTES
    of float32 weights, on the CPU and on CUDA alike (both measured), else "thread"."""
    if setting != "auto":
        return setting
    return "process" if 4 * params >= PROCESS_WRITER_MIN_BYTES else "thread"


class _AlreadyStaged:
    """DCP's AsyncStager protocol for a state dict staged already (Trainer._checkpoint_stager, on the
    compute thread, before the next step may change the weights): dcp.async_save takes it as it is."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _write_staged(staged: Any, checkpoint_id: str, group: Any, process: bool) -> None:
    """On the trainer's write thread (nice 19): write a staged checkpoint over ``group``.

    ``process``: through DCP's process-based async save. Its writer process (one per rank, started on
    the first such save and kept for the run; gloo among the ranks' writers) is spawned from a thread
    this write thread starts, so it inherits nice 19; it maps the staged shared-memory buffers, and it
    is in the trainer's process group, so whatever ends the trainer's group ends it too. This thread
    waits for its result, so the caller's future (finish_checkpoint's wait) means the same in both
    ways: the write is complete on every rank."""
    import torch.distributed.checkpoint as dcp

    if not process:
        dcp.save(staged, checkpoint_id=checkpoint_id, process_group=group)
        return
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if "MASTER_ADDR" not in os.environ and dist.get_world_size(group) == 1:
        # DCP's writers meet at rank 0's MASTER_ADDR (else its host name); one rank in this process (a test,
        # a bench) may have made its group without one: loopback
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    done = dcp.async_save(staged, checkpoint_id=checkpoint_id, process_group=group,
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=_AlreadyStaged())
    # a Future here (the stage is synchronous); an AsyncSaveResponse only with a stager that returns futures
    (done.upload_completion if hasattr(done, "upload_completion") else done).result()


def _lowest_priority() -> None:
    """The calling thread at nice 19 (Linux: a thread's own priority); elsewhere a no-op."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class _Write:
    """A background checkpoint write in flight (Trainer.save_checkpoint with background=True)."""

    def __init__(self, path: str, future: Future, meta: dict[str, Any]) -> None:
        self.path, self.future, self.meta = path, future, meta
        self.started = time.monotonic()


def _seal_checkpoint(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank's DCP write of ``tmp`` finished: trainer.json, fsync every file and the
    folder, rename ``tmp`` -> ``final``, fsync the parent. ``final`` exists only when all of it is on disk."""
    (tmp / CHECKPOINT_META).write_text(json.dumps(meta))
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


# ---------------------------------------------------------------------- request fan-out
class Fanout:
    """Rank 0 sends each request to every rank as msgspec bytes in a uint8 tensor (never pickle)."""

    def __init__(self, device: torch.device, stop: list[bool]) -> None:
        self.device = device
        self._stop = stop  # set by the SIGTERM handler; checked while polling

    def send(self, msg: Msg) -> None:
        payload = protocol.encode(msg)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=self.device), 0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device), 0)

    def recv(self) -> Msg | None:
        """The next request, or None when SIGTERM arrived while waiting."""
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        work = dist.broadcast(n, 0, async_op=True)
        delay = 0.001
        while not work.is_completed():
            if self._stop[0]:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)  # idle ranks wake at most 20 times a second
        work.wait()
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, 0)
        return protocol.TRAINER_REQUESTS.decode(bytes(buf.cpu().numpy()))


def follower_loop(trainer: Trainer, fanout: Fanout) -> None:
    """Ranks 1..R-1: run every request rank 0 broadcasts until Shutdown (or SIGTERM)."""
    while True:
        msg = fanout.recv()
        if msg is None:
            log.info("SIGTERM: leaving")
            return
        try:
            trainer.execute(msg)
        except Exception:
            # Rank 0 hit the same deterministic error (same input) and answers it; keep in step.
            log.exception("%s failed", type(msg).__name__)
        if isinstance(msg, Shutdown):
            return


async def leader_loop(trainer: Trainer, fanout: Fanout, address: str) -> None:
    """Rank 0: serve the controller; fan each request out and run it on the single compute thread."""
    from flashrl.wire.transport import RpcServer

    loop = asyncio.get_running_loop()
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")
    # SendWeights runs here, not on the compute thread: the next TrainStep trains while the engines
    # receive (weight_sync.overlap). One thread: sends stay in request order among themselves.
    sends = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-send")
    sending = [0]
    joins = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weight-sync-join")
    # FinishCheckpoint waits for a background DCP write: here, so training requests are not held up
    seals = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-seal")
    lock = asyncio.Lock()
    stop = asyncio.Event()
    last_busy = [loop.time()]
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def run(msg: Msg) -> Msg | None:
        if not isinstance(msg, _RANK0_ONLY) and trainer.world > 1:  # alone: nobody to fan out to
            fanout.send(msg)
        return trainer.execute(msg)

    async def handle(msg: Msg) -> Msg | None:
        if isinstance(msg, Ping):
            return Pong(version=trainer.version)
        if stop.is_set():
            return Error(message="trainer is shutting down", kind="shutdown")
        if isinstance(msg, InitWeightSync):
            # A (re)started engine joins its own group while training goes on: not on the compute thread.
            return await loop.run_in_executor(joins, trainer.init_weight_sync, msg)
        if isinstance(msg, FinishCheckpoint):
            return await loop.run_in_executor(seals, trainer.execute, msg)
        if isinstance(msg, SendWeights):
            claim = trainer.claim_send(msg.version)  # here, in request order (an error is this request's)
            sending[0] += 1
            try:
                return await loop.run_in_executor(sends, trainer.finish_send, claim, msg.peers)
            finally:
                sending[0] -= 1
                trainer.release_send(claim)
                last_busy[0] = loop.time()
        if isinstance(msg, PrepareWeights):
            trainer.check_prepare(msg.version)
        async with lock:
            try:
                return await loop.run_in_executor(compute, run, msg)
            finally:
                last_busy[0] = loop.time()
                if isinstance(msg, Shutdown):
                    stop.set()

    async def keepalive() -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_S / 4)
            if not lock.locked() and loop.time() - last_busy[0] >= KEEPALIVE_S and trainer.world > 1:
                async with lock:
                    await loop.run_in_executor(compute, fanout.send, Ping())
                    last_busy[0] = loop.time()

    from flashrl.wire.keys import CurveKeys

    keys = CurveKeys.from_env()  # set by the launcher when sockets are off loopback
    server = RpcServer(address, protocol.TRAINER_REQUESTS, handle, name=f"trainer-rank0@{address}",
                       curve=keys.server() if keys is not None else None)
    tasks = [loop.create_task(server.serve(), name="trainer-rpc"), loop.create_task(keepalive(), name="keepalive")]
    log.info("rank 0 serving %s (world %d)", address, trainer.world)
    try:
        # as the engine server does: the RPC server or the keepalive ending before a stop is fatal at once
        # (a dead keepalive leaves the other ranks' receive to time out half an hour later)
        await until_stopped(stop, tasks)
    except TaskDied:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the one that died is the TaskDied's cause
        for ex in (compute, sends, joins, seals):
            ex.shutdown(wait=False, cancel_futures=True)
        raise
    await asyncio.sleep(0.2)  # let the last reply (Shutdown's Ok) leave the socket before it closes
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    busy = lock.locked() or sending[0] > 0
    compute.shutdown(wait=False, cancel_futures=True)
    sends.shutdown(wait=False, cancel_futures=True)
    joins.shutdown(wait=False, cancel_futures=True)
    seals.shutdown(wait=False, cancel_futures=True)
    if busy:
        # SIGTERM in the middle of a request: the compute thread may sit in a collective whose peers
        # are gone; waiting for it could take the whole process-group timeout.
        log.warning("SIGTERM during a request: exiting without waiting for it")
        logging.shutdown()
        os._exit(0)


def main() -> int:
    spec = read_spec_or_exit(TrainerSpec, who="python -m flashrl.trainer.worker", label="trainer worker")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            print(f"trainer worker: environment variable {var} is not set; launch with torchrun or "
                  "flashrl.trainer.client.TrainerGroup", file=sys.stderr)
            return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    child_init(f"trainer rank {rank}")  # dies with the controller (a no-op under torchrun)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg = spec.cfg
    from flashrl.logging_setup import FORMAT

    logging.basicConfig(stream=sys.stderr, level=cfg.run.log_level, format=FORMAT.format(process=f"trainer{rank}"))
    stop = [False]
    if rank != 0:
        def on_term(signum: int, frame: object) -> None:
            stop[0] = True

        signal.signal(signal.SIGTERM, on_term)
    torch.set_num_threads(cfg.trainer.threads)
    backend = resolve_backend(cfg.trainer.backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    # The store listens on MASTER_ADDR only (loopback for the local launcher), not on every interface.
    init_default_group(backend, rank, world, datetime.timedelta(minutes=30))
    try:
        with paused_gc():  # transformers' import and the model build (procs.paused_gc)
            trainer = Trainer(cfg, spec.model, device)
        if spec.resume:
            trainer.load_checkpoint(spec.resume)
        log.info("rank %d/%d ready: backend %s, model %s, version %d", rank, world, backend, spec.model, trainer.version)
        fanout = Fanout(device, stop)
        if rank == 0:
            try:
                asyncio.run(leader_loop(trainer, fanout, spec.address))
            except TaskDied:
                # named, with its cause, then out at once: the other ranks may sit in a collective that
                # destroy_process_group would wait for; the controller sees the rank exit (code 1)
                log.critical("rank 0: a task of the leader loop died; exiting", exc_info=True)
                logging.shutdown()
                os._exit(1)
        else:
            follower_loop(trainer, fanout)
    finally:
        if not stop[0]:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    log.info("rank %d exiting", rank)
    return 0


if __name__ == "__main__":
    exit_now(main())

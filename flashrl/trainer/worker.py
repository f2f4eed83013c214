"""One trainer rank: an FSDP2-sharded Hugging Face causal LM, driven by the controller through rank 0.

    controller --TrainerRequest--> rank 0: RPC shell --> command loop (trainer/loop.py) --broadcast--> ranks 1..R-1
                                            |                 | Trainer.execute(cmd)  <-- same order -->  Trainer.execute(cmd)
                                            |                 | weights: WeightPublisher (trainer/sender.py): one sender
                                            |                 | checkpoints: CheckpointWriter (trainer/ckpt_writer.py)
    controller <--TrainerReply------ rank 0 (only rank 0's result is sent back)

Every rank runs one command loop that takes the commands in order (trainer/loop.py draws it: what
flows in and out, what it waits on, the keepalive, shutdown). Every rank runs the same command
through ``Trainer.execute``, so the collectives inside line up by construction. The commands only
rank 0 acts on (Ping, InitWeightSync, SendWeights, FinishCheckpoint) are not broadcast; ``beside``
hands the last three to the weight sender and the checkpoint writer, whose threads complete them
while the loop goes on (the next TrainStep trains while the engines receive, or a write seals).

The process group backend is ``trainer.backend`` (auto: nccl with CUDA, else gloo); the same code
runs both. On CPU the weights are float32; on GPU (on CPU too with ``trainer.cpu_mixed_precision``) a
non-float32 ``model.dtype`` becomes FSDP2's compute dtype (MixedPrecisionPolicy) with float32 master weights and
gradient reduction.

Entry point (exactly the env vars torchrun sets, so torchrun can launch it on a cluster, plus the
rank's ``TrainerSpec`` as JSON: trainer/spec.py, flashrl/wire/spec.py)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 LOCAL_RANK=0 \\
        FLASHRL_SPEC='{"cfg": {...}, "address": "tcp://127.0.0.1:5555", "model": "PATH"}' python -m flashrl.trainer.worker

The training step itself (phases, metrics) is ``flashrl.trainer.step.PolicyTrainer``, a plain class
that needs no process group; ``Trainer`` here is that class plus the process shell: the model built
(FSDP2-sharded with more than one rank), collectives over the default group, checkpoints, the weight
sync's sending end, and the command loop above.

Limits: an error raised on every rank before any collective (a malformed batch) is a per-command
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
import functools
import json
import logging
import os
import signal
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from flashrl.aio import TaskDied
from flashrl.config import Config
from flashrl.deadlines import checkpoint_timeout_s, model_params
from flashrl.procs import child_init, exit_now, paused_gc
from flashrl.trainer import rng
from flashrl.trainer.ckpt_writer import CHECKPOINT_META, CheckpointWriter, checkpoint_writer
from flashrl.trainer.loop import CommandLoop, Fanout, serve
from flashrl.trainer.sender import WeightPublisher
from flashrl.trainer.spec import TrainerSpec
from flashrl.trainer.step import Collectives, PolicyTrainer, plan_micro_batches
from flashrl.vision.model import is_vision_model, is_vision_param
from flashrl.wire import protocol
from flashrl.wire.protocol import (
    CheckpointSaved,
    ComputeLogprobs,
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

__all__ = ["Trainer", "ProcessCollectives", "plan_micro_batches", "leader_loop", "follower_loop"]

log = logging.getLogger("flashrl.trainer")


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


def banned_bias(banned: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab]: vLLM's strongest logit bias (-100) at the ``banned`` ids (a VLM's image tokens: the engines sample
    with them banned, engine/server.py), 0 elsewhere: the trainer scores the distribution the engines sampled."""
    bias = torch.zeros(vocab, device=device)
    bias[banned] = -100.0
    return bias


class ProcessCollectives(Collectives):
    """The step's reductions over the default process group (every rank calls them in the same order)."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)


def build_policy(model_path: str, mesh: Any, mp: Any, shard: bool, lora: Any = None,
                 freeze_vision: bool = False) -> torch.nn.Module:
    """The HF model at ``model_path`` in float32 (master weights), FSDP2-sharded per decoder layer if ``shard``.
    ``lora`` (trainer/lora.py LoraSpec): wrapped with peft adapters first, only they train. ``freeze_vision``
    (a VLM, ``[vision] freeze``): its vision tower and connector do not train."""
    from torch.distributed.fsdp import fully_shard

    from flashrl.vision.model import auto_class, shard_blocks
    from flashrl.vision.model import freeze_vision as freeze

    vision = is_vision_model(model_path)  # a VLM: AutoModelForImageTextToText, its text and vision layers sharded
    m = auto_class(model_path).from_pretrained(model_path, dtype=torch.float32)
    if freeze_vision:
        freeze(m)
    base = m
    if lora is not None:
        from flashrl.trainer.lora import apply_lora

        m = apply_lora(base, lora)
    if shard:
        for layer in shard_blocks(base) if vision else _decoder_layers(base):
            fully_shard(layer, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        fully_shard(m, mesh=mesh, **({"mp_policy": mp} if mp else {}))
    # No dropout in RL updates: the proximal logprobs must be what the update then differentiates.
    m.train(False)
    return m


class Trainer(PolicyTrainer):
    """One rank: the training step (PolicyTrainer) plus what needs the process group.

    Needs an initialized default process group. ``execute`` must be called on every rank with the same
    message in the same order; it returns the reply on rank 0 (None elsewhere, and None for commands
    rank 0 answers without a reply). ``beside`` is rank 0's: the commands that complete off the loop.

    Every rank holds an FSDP2-sharded model; one rank alone holds the plain module (see ``sharded``
    below), and its metric reductions and request fan-out are skipped (nothing to reduce or send).
    """

    def __init__(self, cfg: Config, model_path: str, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.model_path = model_path
        comm = ProcessCollectives()
        mp = None
        if (device.type == "cuda" or cfg.trainer.cpu_mixed_precision) and cfg.model.dtype != "float32":
            compute = getattr(torch, cfg.model.dtype)
            mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        # One rank alone holds a plain module (no FSDP hooks, all-gathers or DTensors: the same step, less
        # fixed cost); FSDP2 with more ranks, or for a GPU mixed-precision policy (FSDP2 applies it).
        # DCP checkpoints load across the two (tests/integration/test_resume.py resumes at another world size).
        self.sharded = comm.world > 1 or mp is not None
        mesh = init_device_mesh(device.type, (comm.world,)) if self.sharded else None
        self.lora = None
        if cfg.model.lora.rank:
            from flashrl.trainer.lora import spec_of

            self.lora = spec_of(cfg.model.lora)

        def build() -> torch.nn.Module:
            m = build_policy(model_path, mesh, mp, self.sharded, self.lora, cfg.vision.freeze)
            return m if self.sharded else m.to(device)  # fully_shard places a sharded model on the mesh's device

        model = build()
        ref_model = None
        if cfg.algorithm.kl_coef > 0 and self.lora is None:
            # The initial weights, frozen: the KL anchor. With LoRA it is the frozen base of ``model`` itself
            # (adapters bypassed: PolicyTrainer.reference_logprobs), not a second copy.
            ref_model = build()
            ref_model.requires_grad_(False)
        super().__init__(cfg, model, device, ref_model=ref_model, comm=comm)
        if is_vision_model(model_path):  # a VLM: its images' pixels, each processed once on this rank
            from flashrl.vision.batch import PixelCache
            from flashrl.vision.processor import image_token_ids, load_processor

            processor = load_processor(model_path)
            self.pixels = PixelCache(processor)
            text_config: Any = model.config.get_text_config()  # type: ignore[union-attr,operator]  # an HF config
            self.logit_bias = banned_bias(image_token_ids(processor), int(text_config.vocab_size), device)
        self.weights = WeightPublisher()  # rank 0's weight versions and sends (unused elsewhere)
        params = model_params(model_path)
        self.checkpoints = CheckpointWriter(self.rank, device, checkpoint_writer(cfg.trainer.checkpoint_writer, params))
        self.checkpoint_timeout_s = checkpoint_timeout_s(cfg, params)
        if self.lora is not None and self.rank == 0:
            _ = self.base_fingerprint  # now, while the base's bytes are in the page cache: not in a checkpoint's pause

    @functools.cached_property
    def base_fingerprint(self) -> str:
        """LoRA: the base weights' fingerprint (trainer/lora.py base_fingerprint), computed once, at start (rank
        0); recorded in each adapter checkpoint."""
        from flashrl.trainer.lora import base_fingerprint

        return base_fingerprint(self.model_path)

    @property
    def checkpoint_writer(self) -> str:
        """The background writer, "thread" or "process" (trainer.checkpoint_writer resolved); settable
        between checkpoints (doctor and bench/ckpt_async.py try both)."""
        return self.checkpoints.mode

    @checkpoint_writer.setter
    def checkpoint_writer(self, mode: str) -> None:
        self.checkpoints.mode = mode

    # ------------------------------------------------------------------ dispatch
    def beside(self, msg: Msg) -> Future[Any] | None:
        """Rank 0, on the command loop, in command order: hand a command that completes off the loop to
        its owner (a send or a join to the weight sender, a seal to the checkpoint writer) and return its
        reply's future; None for a command the loop runs itself (a PrepareWeights is refused first
        while a publication is still sending: before it fans out, so no rank starts the gather)."""
        if isinstance(msg, SendWeights):
            return self.weights.send(msg.version, msg.peers)
        if isinstance(msg, InitWeightSync):
            return self.weights.join(msg)
        if isinstance(msg, FinishCheckpoint):
            return self.checkpoints.on_seal_thread(lambda: self.execute(msg))
        if isinstance(msg, PrepareWeights):
            self.weights.check_prepare(msg.version)
        return None

    def drop_weight_peer(self, peer: str) -> Msg:
        """Rank 0, on the RPC shell at once (DropWeightPeer): a send stops waiting on dead ``peer``."""
        return self.weights.drop(peer)

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

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """LoRA: the adapter's tensors under peft's saved names (what a sync sends), gathered alone. Every rank
        all-gathers only the adapter's shards (``DTensor.full_tensor``, in parameter order, the same on every
        rank), never the frozen base, whose full gather each sync would cost as much as a full-weight sync's;
        rank 0 gets them on the CPU, the others an empty dict."""
        from torch.distributed.tensor import DTensor

        from flashrl.trainer.lora import adapter_from_state_dict, is_adapter_key

        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            if is_adapter_key(name):
                t = p.detach()
                if isinstance(t, DTensor):
                    t = t.full_tensor()
                if self.rank == 0:
                    out[name] = t.cpu()
        return adapter_from_state_dict(out) if self.rank == 0 else {}

    def prepare_weights(self, version: int) -> WeightManifest | None:
        t0 = time.perf_counter()
        # LoRA: only the adapter's tensors travel (engine/lora.py loads them), and only they are gathered
        sd = self.full_state_dict() if self.lora is None else self.adapter_state()
        if self.rank != 0:
            return None
        from flashrl.moe.weights import checkpoint_layout
        from flashrl.wire.weights import build_manifest

        if self.lora is None:  # a MoE's experts per expert, as its folder has them (vLLM's loader reads that)
            sd = checkpoint_layout(self.model, sd)
        if self.cfg.vision.freeze:  # a frozen vision tower stays what the engines loaded: not sent
            sd = {k: v for k, v in sd.items() if not is_vision_param(k)}
        t1 = time.perf_counter()
        self.weights.drop_prepared()  # free the previous version's buckets before building new ones
        tied = self.tie_word_embeddings and self.lora is None
        manifest, buckets = build_manifest(sd, version, self.cfg.weight_sync.bucket_mb, tie_word_embeddings=tied)
        self.weights.prepare(version, buckets)
        manifest.timings = {"gather_s": t1 - t0, "pack_s": time.perf_counter() - t1}
        return manifest

    def send_weights(self, version: int, peers: list[str] | None = None) -> Ok:
        """Send ``version`` to ``peers`` (None: every joined engine) and wait for it (trainer/sender.py)."""
        return self.weights.send(version, peers).result()

    def init_weight_sync(self, msg: InitWeightSync) -> Ok:
        """Join one engine's group (``msg.peer``) and wait for it (trainer/sender.py)."""
        return self.weights.join(msg).result()

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

        ``background`` (trainer.checkpoint_async): the state is copied into host staging buffers (kept
        between checkpoints: one more host copy of the training state) and this returns; the write goes
        on at the lowest CPU priority, over a gloo group of its own, while training goes on, in a writer
        process or on a write thread (``checkpoint_writer``; trainer/ckpt_writer.py). ``path`` does not
        exist until rank 0's ``finish_checkpoint(path)`` has seen the write complete on every rank and
        renamed it: a crash meanwhile leaves only ``path.tmp``. A save while another is in flight first
        waits for that write. Returns the seconds waited for it.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        waited = self.wait_checkpoint_writes(self.checkpoint_timeout_s)
        err = self.checkpoints.prepare(path) if self.rank == 0 else ""
        if self._agree_error(err):
            raise FileExistsError(err or f"checkpoint {path} refused by rank 0")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if self.lora is not None:  # adapter-only: the frozen base is the model folder's (trainer/lora.py)
            from flashrl.trainer.lora import adapter_entries

            model_sd = adapter_entries(model_sd)
        # every rank's generators (trainer/rng.py: LoRA dropout draws, and ranks draw different amounts), as
        # one table all ranks hold alike (DCP writes one copy), so a resumed run draws what this one would
        rng_table = rng.gather(rng.rank_state(self.device), self.device)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "rng": rng_table}
        if self.critics is not None:
            # replicated plain tensors: DCP writes one copy
            state["critics"], state["critics_optim"] = get_state_dict(self.critics, self.critics.optimizer)
        meta = {"version": self.version, "world_size": self.world, "critics": self.critics is not None,
                "rng": rng.FORMAT, "rng_shape": list(rng_table.shape), "adapter_only": self.lora is not None}
        if self.lora is not None and self.rank == 0:  # the base the adapter is a delta on (resume, export check it)
            meta.update(base_fingerprint=self.base_fingerprint, base_model=self.model_path)
        self.checkpoints.save(path, state, meta, background)
        return waited

    def finish_checkpoint(self, path: str, timeout_s: float) -> float:
        """Rank 0: wait (at most ``timeout_s``) for the background write of ``path`` and seal it; the seconds
        the write took in all. A failed or late write raises and ``path`` never appears."""
        return self.checkpoints.finish(path, timeout_s)

    def wait_checkpoint_writes(self, timeout_s: float) -> float:
        """Wait (at most ``timeout_s``) for every background write of this rank; the seconds waited."""
        return self.checkpoints.wait(timeout_s)

    def close_checkpoints(self, timeout_s: float) -> None:
        """At shutdown: the writes in flight end (bounded); nothing unsealed becomes a checkpoint."""
        self.checkpoints.close(timeout_s)

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
        if adapter_only:  # every rank computes the same answer: all raise together, none waits on another
            from flashrl.trainer.lora import base_mismatch

            bad = base_mismatch(meta.get("base_fingerprint"), meta.get("base_model"), self.model_path, f"checkpoint {path}")
            if bad:
                raise ValueError(bad)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if adapter_only:  # the base weights stay the model folder's, loaded at build
            from flashrl.trainer.lora import adapter_entries

            model_sd = adapter_entries(model_sd)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if meta.get("rng") == rng.FORMAT:  # every rank's generators
            state["rng"] = torch.empty(meta["rng_shape"], dtype=torch.uint8)
        elif meta.get("rng"):  # older checkpoints: one CPU state for every rank
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
            if state["rng"].dim() == 2:
                rng.restore(state["rng"], self.rank, self.device)
            else:  # an older checkpoint's one CPU state
                torch.set_rng_state(state["rng"])
        self.version = int(meta["version"])

    def _agree_error(self, err: str) -> bool:
        """Broadcast whether rank 0 found an error, so every rank skips the collectives together."""
        flag = torch.tensor([1 if err else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())


def follower_loop(trainer: Trainer, fanout: Fanout) -> None:
    """Ranks 1..R-1: run every command rank 0 broadcasts until Shutdown (or SIGTERM)."""
    CommandLoop(trainer, fanout).run()


async def leader_loop(trainer: Trainer, fanout: Fanout, address: str) -> None:
    """Rank 0: serve the controller at ``address`` through the command loop (trainer/loop.py) until
    Shutdown or SIGTERM; a loop or server that dies first raises TaskDied."""
    from flashrl.wire.keys import CurveKeys
    from flashrl.wire.transport import RpcServer

    keys = CurveKeys.from_env()  # set by the launcher when sockets are off loopback
    commands = CommandLoop(trainer, fanout)
    try:
        ended = await serve(commands, lambda handle: RpcServer(
            address, protocol.TRAINER_REQUESTS, handle, name=f"trainer-rank0@{address}",
            curve=keys.server() if keys is not None else None), busy=lambda: trainer.weights.busy, address=address)
    finally:
        trainer.weights.close()
    if not ended:
        # a command may sit in a collective whose peers are gone: waiting for it could take the whole
        # process-group timeout
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
            if stop[0]:
                log.info("SIGTERM: leaving")
    finally:
        if not stop[0]:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    log.info("rank %d exiting", rank)
    return 0


if __name__ == "__main__":
    exit_now(main())

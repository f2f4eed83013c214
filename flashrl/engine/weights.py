"""Receiving side of the weight sync: runs inside vLLM's worker (in the engine process).

    engine server (InprocEngine, asyncio)             vLLM worker (this module, blocking calls)
      InitWeightSync -> collective_rpc("flashrl_init_weight_sync", args) -> join_group(rank 1 + i)
      UpdateWeights  -> [a thread of its own: the engine thread steps on, serving the old weights]
                     -> collective_rpc("flashrl_receive_weights", manifest JSON)
                            receive every bucket (broadcast from group rank 0) into buffers of its own
                            (host buffers reused from the last loaded sync: WeightReceiver.release)
                            verify every checksum          -- any mismatch: drop buffers, report
                     -> [engine thread, between two steps: nothing generates]
                     -> collective_rpc("flashrl_load_weights", version)
                            reload_weights(all tensors)    -- only after every bucket passed
                     -> set version label, clear the KV cache, step on

That is ``weight_sync.load = "whole"``: the engine holds one more copy of the weights (every bucket) while
a sync is received, verified and loaded. ``weight_sync.load = "bucket"`` bounds that copy to a few buckets:

      UpdateWeights  -> check_manifest (names, shapes, dtypes, checksum algorithms, total bytes): a bad one is
                        refused before a byte arrives (the broadcast is still taken, into scratch)
                     -> [a thread of its own] collective_rpc("flashrl_open_stream", manifest JSON)
                            receive bucket 0, verify it (bucket 1 already transferring)
                     -> [engine thread: nothing generates from here]
                     -> collective_rpc("flashrl_load_stream", version)
                            reload_weights(BucketStream): bucket k's tensors are handed to vLLM's loader
                            only after its checksum passed; bucket k+1 transfers while k loads
                     -> every bucket verified and loaded: set version label, clear the KV cache, step on

The trade-off, in bucket mode: generation stops for the whole transfer (not just the load), and a bucket
found corrupt after an earlier one was loaded leaves the model partly written (no copy of the old weights
is kept: that copy is what this mode saves). The engine then never steps again, answers the error naming
the bucket, and exits (the controller restarts it, when it restarts engines, with verified weights); its
version label never moves to the new version. A corrupt first bucket loads nothing: the sync is refused
and the old weights serve on, as in whole mode.

In whole mode the model's parameters are never written until every bucket has arrived and passed its
checksum, so a failed sync leaves the previous weights serving. Every bucket is received even after a
mismatch: the broadcast is a collective, and leaving it early would hang the other members.
The receive touches nothing of vLLM's: it fills buffers of its own, so it runs beside generation
(vLLM's in-process executor, ``distributed_executor_backend="uni"``, runs a worker method on the calling
thread); only the load stops the engine, for the time ``reload_weights`` takes.

Why a worker extension (``AsyncEngineArgs(worker_extension_cls=...)``) and not vLLM's native
weight-transfer API (``WeightTransferEngineFactory``): a custom backend must be registered inside the
worker process, which vLLM only offers through an installed plugin entry point, and the native
lifecycle (start -> update chunk by chunk -> finish) loads each chunk as it arrives, while this sync
must verify everything before loading anything. The methods below take plain data (str, int, JSON
text), so no ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is needed.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from flashrl.moe.capture import RouteCaptureExtension
from flashrl.moe.reload import ExpertProbe, repack_cpu_experts
from flashrl.wire.protocol import WeightManifest
from flashrl.wire.weights import (
    DTYPES,
    bucket_nbytes,
    check_manifest,
    group_device,
    join_group,
    manifest_nbytes,
    unpack_bucket,
    verify_checksum,
)

log = logging.getLogger(__name__)

WORKER_EXTENSION = "flashrl.engine.weights.WeightSyncExtension"


class WeightReceiver:
    """One engine's end of the weight-sync group (no vLLM here: unit-testable on its own)."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None
        self._device = torch.device("cpu")
        self.verify_s = 0.0  # the last receive's checksum time (part of its receive_s)
        # what the last receive verified, waiting for its load: (version, named tensors)
        self.pending: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        # Host receive buffers: those of the last receive (``_held``), and those released after a load or a
        # drop (``_spare``), reused by the next receive of the same bucket shapes. A fresh host buffer pays
        # a page fault per 4 KiB on first write: ~1 s per GiB on the dev host, as long as the transfer itself
        # (bench/results/realsize/sync.md). CUDA buffers need no pool: torch's caching allocator reuses them.
        self._held: list[torch.Tensor] = []
        self._spare: list[torch.Tensor] = []
        # The bucket-by-bucket load's buffers (BucketStream), reused within a sync and across syncs (host memory).
        self._slots: list[_Slot] = []
        self.stream: BucketStream | None = None  # an opened stream, waiting for its load

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        for k, b in enumerate(self._spare):
            if b.numel() == numel and b.dtype == dtype:
                return self._spare.pop(k)
        return torch.empty(numel, dtype=dtype, device=self._device)

    def release(self, live: list[torch.Tensor] | None = None) -> int:
        """The last receive's buffers are no longer needed (loaded, i.e. copied into the model, or dropped):
        keep them for the next receive (host memory only; the rest is freed). A buffer sharing memory with
        any of ``live`` (the model's parameters: a loader that kept a view instead of copying) is never
        reused, so a later receive cannot write into served weights. Returns the bytes kept."""
        held, self._held = self._held, []
        if self._device.type != "cpu":
            self._spare = []
            return 0
        spans = []
        for t in live or []:
            st = t.untyped_storage()
            spans.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        keep = []
        for b in held:
            lo, hi = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
            if not any(a < hi and lo < z for a, z in spans):
                keep.append(b)
        self._spare = keep
        return sum(b.numel() * b.element_size() for b in keep)

    @property
    def joined(self) -> bool:
        return self._group is not None

    def init(self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        if rank < 1:
            raise ValueError(f"weight sync: engine rank must be >= 1 (rank 0 is the trainer), got {rank}")
        self._group = join_group(master_addr, master_port, rank, world_size, backend, timeout_s)
        self._device = group_device(backend)
        log.info("weight sync: joined %s group of %d as rank %d", backend, world_size, rank)

    def receive(self, manifest: WeightManifest, overlap: bool = True) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
        """Receive every bucket of ``manifest``; return (named tensors, checksum errors).

        The tensors are views of fresh buffers; when errors is non-empty they must not be loaded.
        ``overlap``: post bucket i+1's receive before verifying bucket i, so the checksum of one bucket
        runs while the next one transfers (the hash releases the GIL or is short: xxh3 hashes 64 MiB in ~4 ms; gloo and nccl run the transfer on
        their own threads / streams). Buckets still complete in manifest order (one group, ops matched
        in issue order). At 0.27B parameters (1 GiB, 15 buckets) on the 2-core dev host the serial
        receive + verify took 2-3x the transfer alone (bench/results/realsize/sync.md).
        """
        if self._group is None:
            raise RuntimeError("UpdateWeights before InitWeightSync: the engine has not joined the weight-sync group")
        named: list[tuple[str, torch.Tensor]] = []
        errors: list[str] = []
        self.verify_s = 0.0
        self._held = []  # buffers of a receive nobody released are never reused (only release() checks aliasing)
        pending: tuple[int, Any, torch.Tensor, Any] | None = None
        for i, bucket in enumerate(manifest.buckets):
            if bucket.dtype not in DTYPES:
                # Still take part in the broadcast (as raw bytes of the right size) to keep the group aligned.
                errors.append(f"bucket {i}: unsupported dtype {bucket.dtype!r}")
            dtype = DTYPES.get(bucket.dtype, torch.float32)
            flat = self._buffer(bucket.numel, dtype)
            self._held.append(flat)
            work = self._group.broadcast(flat, 0)  # type: ignore[union-attr]  # Backend.broadcast: bound in C++, not in torch stubs
            if not overlap:
                work.wait()
            if pending is not None:
                self._verify(*pending, named, errors)
            pending = (i, bucket, flat, work)
        if pending is not None:
            self._verify(*pending, named, errors)
        self._spare = []  # spares of other shapes than this manifest's: freed
        return named, errors

    @property
    def held_bytes(self) -> int:
        """Bytes of the receive buffers this receiver holds now (whole mode: the last receive's, or its spares;
        bucket mode: its slots): the engine's memory beyond the model for the weight sync."""
        tensors = [*self._held, *self._spare]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(s.nbytes for s in self._slots)

    def open_stream(self, manifest: WeightManifest, live: list[torch.Tensor]) -> BucketStream:
        """Start a bucket-by-bucket receive of ``manifest`` (see BucketStream); ``live``: the model's
        parameters, whose memory no receive buffer may share. The whole mode's buffers are freed first."""
        if self._group is None:
            raise RuntimeError("UpdateWeights before InitWeightSync: the engine has not joined the weight-sync group")
        self._held, self._spare = [], []
        # an opened stream never loaded (its load call failed): dropped; nothing of it reached the model
        self.stream = BucketStream(self, manifest, live)
        return self.stream

    def _slot(self, nbytes: int, serving: list[tuple[int, int]]) -> _Slot:
        """A free slot of at least ``nbytes`` (the smallest that fits), or a new one of exactly ``nbytes``."""
        free = [s for s in self._slots if s.nbytes >= nbytes and s.free(serving)]
        if free:
            return min(free, key=lambda s: s.nbytes)
        slot = _Slot(nbytes, self._device)
        self._slots.append(slot)
        return slot

    def end_stream(self, live: list[torch.Tensor]) -> None:
        """After a bucket-by-bucket load: keep the slots for the next sync (host memory only), minus any that
        shares memory with ``live`` (a loader that kept a view instead of copying: never written again)."""
        self.stream = None
        if self._device.type != "cpu":
            self._slots = []
            return
        spans = _spans(live)
        self._slots = [s for s in self._slots if not s.overlaps(spans)]

    def _verify(self, i: int, bucket: Any, flat: torch.Tensor, work: Any, named: list[tuple[str, torch.Tensor]],
                errors: list[str]) -> None:
        """Wait for bucket ``i``'s broadcast, check its checksum, unpack it into ``named`` (or add an error)."""
        work.wait()
        t0 = time.perf_counter()
        got = verify_checksum(flat, bucket.checksum)
        self.verify_s += time.perf_counter() - t0
        if got != bucket.checksum:
            names = ", ".join(s.name for s in bucket.tensors[:3])
            errors.append(f"bucket {i} ({names}...): checksum {got} != manifest {bucket.checksum}")
            return
        try:
            named.extend(unpack_bucket(bucket, flat))
        except ValueError as e:
            errors.append(f"bucket {i}: {e}")


def _spans(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) byte addresses of the storages of ``tensors`` (meta tensors have none)."""
    spans = []
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            spans.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
    return spans


class _Slot:
    """One receive buffer of the bucket-by-bucket load (raw bytes; a bucket uses a prefix of it), with weak
    references to every tensor handed out of it. It is reused only when all of those are gone (vLLM's
    layer-wise reload keeps a layer's loaded tensors until the layer's last tensor arrives, which may be in a
    later bucket) and it shares no memory with a serving parameter."""

    __slots__ = ("buf", "nbytes", "views", "receiving")

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self.views: list[weakref.ref[torch.Tensor]] = []
        self.receiving = False  # a receive into it is posted and not yet verified (or drained)

    def overlaps(self, spans: list[tuple[int, int]]) -> bool:
        lo = self.buf.data_ptr()
        hi = lo + self.nbytes
        return any(a < hi and lo < z for a, z in spans)

    def free(self, serving: list[tuple[int, int]]) -> bool:
        return not self.receiving and all(r() is None for r in self.views) and not self.overlaps(serving)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.views = []
        self.receiving = True
        return self.buf[: numel * dtype.itemsize].view(dtype)


class BucketStream:
    """One bucket-by-bucket sync (``weight_sync.load = "bucket"``) of a manifest that passed ``check_manifest``.

    ``open()`` (beside generation) posts the receives of buckets 0 and 1 and verifies bucket 0. Iterating
    (inside vLLM's ``reload_weights``, on the engine thread) yields bucket k's (name, tensor) pairs only after
    bucket k's checksum passed, then posts bucket k+2 and verifies k+1. So the receive buffers in use are
    the bucket just loaded (the loader's loop still holds its last tensor), the next one, verified, the one
    posted, and the earlier ones a partly-loaded layer still references (vLLM keeps a layer's tensors until its
    last one arrives): about (buckets one layer spans) + 2, a few buckets, never the whole model
    (``extra_bytes``: every slot's bytes, measured).

    Invariants: nothing of a bucket reaches the loader before its checksum passed; after the first bad bucket
    nothing more does (``error`` names it, ``loaded`` says how many buckets the loader got: 0 = the model is
    untouched); every bucket of the manifest is received even then (``drain``), so the group stays aligned and
    the trainer's broadcast to this engine ends cleanly.
    """

    def __init__(self, receiver: WeightReceiver, manifest: WeightManifest, live: list[torch.Tensor]) -> None:
        self.receiver = receiver
        self.manifest = manifest
        self.version = manifest.version
        self.error = ""
        self.loaded = 0  # buckets whose tensors went to the loader
        self.verify_s = 0.0
        self.nbytes = manifest_nbytes(manifest)
        self._serving = _spans(live)  # taken before the reload: during it vLLM swaps parameters for meta tensors
        self._next = 0  # the next bucket to post
        self._posted: deque[tuple[int, Any, torch.Tensor, Any, _Slot]] = deque()
        self._ready: list[tuple[str, torch.Tensor]] | None = None  # the verified bucket waiting to be loaded
        self._ready_slot: _Slot | None = None

    @property
    def extra_bytes(self) -> int:
        return sum(s.nbytes for s in self.receiver._slots)

    def _post(self) -> None:
        if self._next >= len(self.manifest.buckets):
            return
        i, bucket = self._next, self.manifest.buckets[self._next]
        self._next += 1
        slot = self.receiver._slot(bucket_nbytes(bucket), self._serving)
        flat = slot.take(bucket.numel, DTYPES[bucket.dtype])
        group = self.receiver._group
        assert group is not None
        work = group.broadcast(flat, 0)  # type: ignore[union-attr]  # Backend.broadcast: bound in C++
        self._posted.append((i, bucket, flat, work, slot))

    def _take(self) -> None:
        """Wait for the oldest posted bucket, verify it: ready to load, or ``error`` set."""
        i, bucket, flat, work, slot = self._posted.popleft()
        work.wait()
        slot.receiving = False  # from here on, the views handed out (if any) keep it from reuse
        t0 = time.perf_counter()
        got = verify_checksum(flat, bucket.checksum)
        self.verify_s += time.perf_counter() - t0
        if got != bucket.checksum:
            names = ", ".join(s.name for s in bucket.tensors[:3])
            self.error = (f"bucket {i} of {len(self.manifest.buckets)} ({names}...): checksum {got} != manifest "
                          f"{bucket.checksum}")
            return
        named = list(unpack_bucket(bucket, flat))  # check_manifest made sure the shapes add up
        slot.views = [weakref.ref(t) for _, t in named]
        self._ready, self._ready_slot = named, slot

    def open(self) -> bool:
        """Beside generation: buckets 0 and 1 posted, bucket 0 received and verified. False: bucket 0 is bad
        (``error``; the rest is drained, nothing was loaded)."""
        self._post()
        self._post()
        self._take()
        if self.error:
            self.drain()
        return not self.error

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            while self._ready is not None and not self.error:
                named, self._ready, self._ready_slot = self._ready, None, None
                self.loaded += 1
                while named:  # popped as handed over: this frame holds no reference to what the loader freed
                    yield named.pop(0)
                if not self._posted:
                    break
                self._post()
                self._take()
        finally:
            self.drain()

    def drain(self) -> None:
        """Receive whatever of the manifest is not received yet, into scratch (the group stays aligned).
        Never raises: a transfer that fails here (the trainer died, the group timed out) ends the drain and is
        recorded in ``error`` if nothing was before."""
        self._ready, self._ready_slot = None, None
        try:
            while self._posted:
                _, _, _, work, slot = self._posted.popleft()
                work.wait()
                slot.receiving = False
            while self._next < len(self.manifest.buckets):
                self._post()
                _, _, _, work, slot = self._posted.popleft()
                work.wait()
                slot.receiving = False
        except Exception as e:  # the group is broken: the engine's error path reports it (never loads more)
            self._posted.clear()
            self._next = len(self.manifest.buckets)
            self.error = self.error or f"receiving the rest of the sync failed: {type(e).__name__}: {e}"


def _tied_layers(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, Any]]]:
    """vLLM layers that share one weight storage (tied embeddings), each group with its layers' quant methods."""
    by_storage: dict[int, list[tuple[torch.nn.Module, Any]]] = {}  # weight storage -> (layer, its quant method)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)  # vLLM's layers; no torch attribute, so no type here
        if method is not None and isinstance(weight, torch.Tensor) and weight.numel():
            by_storage.setdefault(weight.data_ptr(), []).append((module, method))
    return [layers for layers in by_storage.values() if len(layers) > 1]


def refresh_tied_layers(model: torch.nn.Module) -> int:
    """Redo the weight processing of layers that share a weight (tied embeddings); return how many.

    vLLM 0.32's in-place reload processes a layer only when weights arrive for it. With tied
    embeddings the loader skips ``lm_head.weight``, so the LM head is never reprocessed, and on the
    CPU its processing packed a private copy of the weight for the GEMM kernel: without this the
    engine would sample from the new embeddings but the old output projection. Re-running
    ``process_weights_after_loading`` re-packs from the (already updated) shared weight; where that
    processing is a no-op (the GPU path for unquantized embeddings) this costs nothing.
    """
    refreshed = 0
    for layers in _tied_layers(model):
        for module, method in layers:
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


# What vLLM logs on every weight sync that is expected here and said by the sync's own line ("engine0: weights
# v12 loaded in 0.021s ..."), by vLLM logger: 4 of the 5 lines each sync wrote, 80% of an engine's log.
_SYNC_CHATTER: dict[str, tuple[str, ...]] = {
    "vllm.model_executor.model_loader.reload.inplace": ("Reloading and processing weights took",),
    "vllm.v1.core.block_pool": ("Successfully reset prefix cache",),  # the KV reset after each load
    # a vision-language model's encoder cache reset after each load (engine/server.py): requests in flight are
    # recomputed from their first token (reset_running_requests), their images' encoder outputs too
    "vllm.v1.engine.core": ("Resetting the encoder cache when requests are in progress",),
    # the rotary embedding's cos/sin cache is no checkpoint tensor: the reload puts the cached one back
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
}
_TIED_HEAD = "ParallelLMHead: Failed to load weights"  # the loader skips a tied lm_head; refresh_tied_layers redoes it


class DropMessages(logging.Filter):
    """A logger filter that drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def quiet_sync_chatter(model: torch.nn.Module) -> list[str]:
    """Filter out of the engine's log what vLLM says on every weight sync that is expected here (the tied LM
    head's warning only when the model's embeddings are tied: anywhere else it means a weight did not load);
    every other message, every other layer's "Failed to load weights" included, passes. Returns what is
    filtered; idempotent."""
    dropped: list[str] = []
    for name, prefixes in _SYNC_CHATTER.items():
        if name.endswith(".layerwise") and _tied_layers(model):
            prefixes = (*prefixes, _TIED_HEAD)
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, DropMessages)]:
            logger.removeFilter(f)
        logger.addFilter(DropMessages(prefixes))
        dropped += prefixes
    return dropped


def load_into(worker: Any, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load verified ``named`` tensors into the model of vLLM's ``worker``: a weight sync's load (also timed
    alone by bench/engine_reload.py).

    reload_weights, not model.load_weights: vLLM's CPU backend repacks linear weights after loading, and
    only the reload path redoes that processing (a plain load would serve unpacked weights); then the tied layers it skips."""
    probe = ExpertProbe(named)  # a MoE on the CPU: its experts repacked after the reload (flashrl/moe/reload.py)
    worker.reload_weights(weights_iterator=iter(probe))
    model = worker.model_runner.get_model()
    refresh_tied_layers(model)
    repack_cpu_experts(model, probe)


class WeightSyncExtension(RouteCaptureExtension):
    """Mixed into vLLM's worker class; ``self`` is the worker (it has ``reload_weights``). Also MoE route
    capture's methods (flashrl/moe/capture.py): vLLM takes one extension class."""

    def _flashrl_receiver(self) -> WeightReceiver:
        recv = getattr(self, "_flashrl_recv", None)
        if recv is None:
            recv = WeightReceiver()
            self._flashrl_recv = recv
        return recv

    def flashrl_init_weight_sync(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        self._flashrl_receiver().init(master_addr, master_port, rank, world_size, backend, timeout_s)
        dropped = quiet_sync_chatter(self.model_runner.get_model())  # type: ignore[attr-defined]  # vLLM's worker
        log.info("weight sync: vLLM's per-sync messages expected here are left out of this log: %s",
                 "; ".join(f"'{m}...'" for m in dropped))

    def flashrl_receive_weights(self, manifest_json: str) -> dict[str, Any]:
        """Receive and verify every bucket into buffers of its own, kept for ``flashrl_load_weights``. Returns ok,
        error, timings. Touches none of vLLM's state: the engine server runs it beside generation."""
        manifest = msgspec.json.decode(manifest_json, type=WeightManifest)
        t0 = time.perf_counter()
        receiver = self._flashrl_receiver()
        if receiver.pending is not None:  # an earlier receive never loaded is dropped, not served
            receiver.pending = None
            receiver.release(list(self.model_runner.get_model().parameters()))  # type: ignore[attr-defined]  # vLLM's worker
        named, errors = receiver.receive(manifest)
        res: dict[str, Any] = {"ok": not errors, "error": "; ".join(errors), "receive_s": time.perf_counter() - t0,
                               "verify_s": receiver.verify_s, "extra_bytes": receiver.held_bytes}
        if errors:
            log.error("weight sync v%d rejected, keeping the previous weights: %s", manifest.version, res["error"])
        else:
            receiver.pending = (manifest.version, named)
        return res

    def flashrl_load_weights(self, version: int) -> dict[str, Any]:
        """Load the weights the last receive verified for ``version`` (on the engine thread, between two steps).
        Returns ok, error, touched (False: the old weights are intact), load_s."""
        receiver = self._flashrl_receiver()
        pending, receiver.pending = receiver.pending, None
        if pending is None or pending[0] != version:
            have = "nothing" if pending is None else f"v{pending[0]}"
            return {"ok": False, "touched": False, "load_s": 0.0,
                    "error": f"no verified weights of v{version} to load (the last receive holds {have})"}
        t0 = time.perf_counter()
        try:
            load_into(self, pending[1])
        except Exception as e:
            log.exception("weight sync v%d: loading failed after the checks passed", version)
            return {"ok": False, "touched": True, "error": f"load failed: {type(e).__name__}: {e}",
                    "load_s": time.perf_counter() - t0}
        finally:
            # the loader copied the tensors into the model: the buffers serve the next receive (never one
            # that shares memory with a parameter)
            receiver.release(list(self.model_runner.get_model().parameters()))  # type: ignore[attr-defined]  # vLLM's worker
        return {"ok": True, "touched": True, "error": "", "load_s": time.perf_counter() - t0}

    def flashrl_take_weights(self, version: int) -> dict[str, Any]:
        """LoRA (engine/lora.py): the tensors the last receive verified for ``version``, copied out of the
        receive buffers (which then serve the next receive), for the caller to load as an adapter.
        Returns ok, error, tensors ({name: tensor}); nothing of vLLM's is touched."""
        receiver = self._flashrl_receiver()
        pending, receiver.pending = receiver.pending, None
        if pending is None or pending[0] != version:
            have = "nothing" if pending is None else f"v{pending[0]}"
            return {"ok": False, "error": f"no verified adapter of v{version} (the last receive holds {have})", "tensors": {}}
        tensors = {name: t.clone() for name, t in pending[1]}
        receiver.release(list(self.model_runner.get_model().parameters()))  # type: ignore[attr-defined]  # vLLM's worker
        return {"ok": True, "error": "", "tensors": tensors}

    # ------------------------------------------------------------------ weight_sync.load = "bucket"
    def flashrl_open_stream(self, manifest_json: str) -> dict[str, Any]:
        """Bucket mode, beside generation: check the manifest, receive and verify its first bucket. Returns ok,
        error, receive_s, verify_s, extra_bytes. Not ok: nothing was loaded (the broadcast was still taken, into
        scratch, so the group stays aligned) and there is nothing to load."""
        manifest = msgspec.json.decode(manifest_json, type=WeightManifest)
        t0 = time.perf_counter()
        receiver = self._flashrl_receiver()
        receiver.pending = None  # a whole-mode receive never loaded (a mode switch in tests): dropped
        model = self.model_runner.get_model()  # type: ignore[attr-defined]  # vLLM's worker
        stream = receiver.open_stream(manifest, list(model.parameters()))
        problems = check_manifest(manifest)
        if problems:
            stream.drain()
            receiver.stream = None
            error = "manifest refused before loading: " + "; ".join(problems)
        else:
            try:
                error = "" if stream.open() else stream.error
            except Exception:  # the transfer failed: nothing was loaded; the caller reports it
                receiver.stream = None
                raise
            if error:
                receiver.stream = None
        res = {"ok": not error, "error": error, "receive_s": time.perf_counter() - t0, "verify_s": stream.verify_s,
               "extra_bytes": stream.extra_bytes}
        if error:
            log.error("weight sync v%d rejected before loading, keeping the previous weights: %s", manifest.version, error)
        return res

    def flashrl_load_stream(self, version: int) -> dict[str, Any]:
        """Bucket mode, on the engine thread (nothing generates): receive, verify and load the opened stream's
        remaining buckets one at a time. Returns ok, error, touched (False: the old weights are intact), load_s
        (receive + verify + load: generation was stopped for all of it), verify_s, extra_bytes.

        ok only when every bucket was verified and loaded. A bucket that fails after an earlier one loaded leaves
        the model partly written: touched, and the caller must never serve it (the server halts and exits)."""
        receiver = self._flashrl_receiver()
        stream, receiver.stream = receiver.stream, None
        if stream is None or stream.version != version:
            have = "nothing" if stream is None else f"v{stream.version}"
            if stream is not None:
                stream.drain()
            return {"ok": False, "touched": False, "load_s": 0.0, "verify_s": 0.0, "extra_bytes": 0,
                    "error": f"no opened bucket stream of v{version} to load (the last open holds {have})"}
        t0 = time.perf_counter()
        error = ""
        try:
            load_into(self, stream)
        except Exception as e:
            log.exception("weight sync v%d: loading bucket %d failed", version, stream.loaded)
            error = f"load failed at bucket {stream.loaded - 1}: {type(e).__name__}: {e}"
        finally:
            stream.drain()
            receiver.end_stream(list(self.model_runner.get_model().parameters()))  # type: ignore[attr-defined]  # vLLM's worker
        if not error and stream.error:
            error = stream.error
        if error:
            error += (f"; {stream.loaded} of {len(stream.manifest.buckets)} buckets were loaded: the model holds "
                      "partly-new weights and must not serve") if stream.loaded else "; nothing was loaded"
        return {"ok": not error, "touched": stream.loaded > 0, "error": error, "load_s": time.perf_counter() - t0,
                "verify_s": stream.verify_s, "extra_bytes": stream.extra_bytes}

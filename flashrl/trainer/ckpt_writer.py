"""One trainer rank's checkpoint writer: every way a DCP checkpoint reaches disk, behind one interface.

    command loop --save(path, state, meta)--> now: dcp.save(path.tmp) here; rank 0 seals; barrier
                 --save(..., background)----> staged here (host copy), then
                                                 write thread (nice 19): dcp.save(path.tmp) over a gloo group
                                                 of its own (DCP's writer process, or this thread)
    rank 0       --finish(path, timeout)----> seal thread (on_seal_thread): waits for that write (deadline), then seals:
                                                 trainer.json, fsync, rename path.tmp -> path
                 <--Future(seconds the write took in all)-- (TimeoutError / the write's error: no checkpoint)
    every rank   --wait(timeout) / close(timeout)--> the writes in flight end (bounded); nothing is sealed

The invariant: ``path`` exists only once every rank's write of it completed and rank 0 sealed it; a
crash (even SIGKILL) anywhere before leaves at most ``path.tmp``, which the next save of ``path``
removes. At most one background write is in flight per rank: a save first waits for the previous one.

Why two threads: the write thread runs at the lowest CPU priority (the step beside it goes first
where cores are short) and blocks in DCP's collectives among the ranks' writers; the seal thread only
waits (with the request's deadline) and renames, so a FinishCheckpoint neither holds the command loop
nor queues behind the next write.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from flashrl.checkpoint import fsync_dir

log = logging.getLogger("flashrl.trainer")
T = TypeVar("T")

CHECKPOINT_META = "trainer.json"

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


class CheckpointWriter:
    """The checkpoint writes of one rank (``rank``) on ``device``; ``mode`` is "thread" or "process"
    (trainer.checkpoint_writer resolved), settable between checkpoints.

    ``save`` runs on the command loop (every rank, same order); ``finish`` on rank 0 only; ``wait`` and
    ``close`` on every rank."""

    def __init__(self, rank: int, device: torch.device, mode: str) -> None:
        self.rank, self.device, self.mode = rank, device, mode
        self._writes: dict[str, _Write] = {}  # background writes by path: save adds, finish / wait remove
        self._lock = threading.Lock()
        self._group: Any = None
        self._stager: Any = None
        self._write_thread: ThreadPoolExecutor | None = None
        self._seal_thread: ThreadPoolExecutor | None = None

    def prepare(self, path: str) -> str:
        """Rank 0, before a save of ``path``: the error refusing it ("" if none). An existing ``path`` is
        refused (never overwritten in place); a leftover ``path.tmp`` from a crash is removed."""
        final, tmp = Path(path), Path(path + ".tmp")
        if final.exists():
            return f"checkpoint {final} already exists; choose a new path or delete it"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        return ""

    def save(self, path: str, state: dict[str, Any], meta: dict[str, Any], background: bool) -> None:
        """Write ``state`` (every rank, in the same order) as checkpoint ``path``.

        Not ``background``: DCP saves ``path.tmp`` here, rank 0 seals it, every rank meets at a barrier.
        ``background``: ``state`` is copied into host staging buffers (kept between checkpoints) before
        this returns (the next step may change the weights at once), then written on the write thread;
        ``path`` appears when rank 0's ``finish(path)`` has seen the write complete."""
        tmp = path + ".tmp"
        if not background:
            import torch.distributed.checkpoint as dcp

            dcp.save(state, checkpoint_id=tmp)
            if self.rank == 0:
                seal_checkpoint(Path(tmp), Path(path), meta)
            dist.barrier()
            return
        staged = self._checkpoint_stager().stage(state)
        group = self._checkpoint_group()
        if self._write_thread is None:
            self._write_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write",
                                                    initializer=_lowest_priority)
        future = self._write_thread.submit(_write_staged, staged, tmp, group, self.mode == "process")
        with self._lock:
            self._writes[path] = _Write(path=path, future=future, meta=meta)

    def finish(self, path: str, timeout_s: float) -> float:
        """Rank 0: wait (at most ``timeout_s``) for the background write of ``path`` and seal it. Rank 0's
        DCP save returns only after every rank's write results reached it (DCP's final gather), so its
        completion means the whole checkpoint is on disk. Returns the seconds the write took in all. A
        failed or late write raises and ``path`` never appears."""
        with self._lock:
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
                with self._lock:
                    self._writes.pop(path, None)
        seal_checkpoint(Path(path + ".tmp"), Path(path), w.meta)
        return time.monotonic() - w.started

    def on_seal_thread(self, fn: Callable[[], T]) -> Future[T]:
        """``fn`` (rank 0's FinishCheckpoint: ``finish``) on the seal thread: the command loop goes on
        while the write ends."""
        if self._seal_thread is None:
            self._seal_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-seal")
        return self._seal_thread.submit(fn)

    def wait(self, timeout_s: float) -> float:
        """Wait (at most ``timeout_s``) for every background write of this rank; the seconds waited.

        A write that failed or is late is logged and forgotten (its ``path.tmp`` is never renamed into a
        checkpoint); rank 0 forgets a finished write nobody sealed (its ``finish`` never came)."""
        with self._lock:
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

    def close(self, timeout_s: float) -> None:
        """At shutdown: wait (at most ``timeout_s``) for the writes in flight, then free the staging buffers
        and the threads. Nothing is sealed here: only ``finish`` makes a checkpoint (a half write never counts)."""
        self.wait(timeout_s)
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        for pool in (self._write_thread, self._seal_thread):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._write_thread = self._seal_thread = None

    def _checkpoint_group(self) -> Any:
        """A gloo group for background DCP writes: the write thread's collectives then never interleave
        with the command loop's on the default group (and async_save needs a CPU backend under NCCL).
        Made on the first background save, which every rank runs in the same command order."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

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
                    use_pinned_memory=False, use_shared_memory=self.mode == "process",
                    use_async_staging=False, use_non_blocking_copy=False))
        return self._stager


class _Write:
    """A background checkpoint write in flight (CheckpointWriter.save with background=True)."""

    def __init__(self, path: str, future: Future, meta: dict[str, Any]) -> None:
        self.path, self.future, self.meta = path, future, meta
        self.started = time.monotonic()


class _AlreadyStaged:
    """DCP's AsyncStager protocol for a state dict staged already (CheckpointWriter._checkpoint_stager, on
    the command loop, before the next step may change the weights): dcp.async_save takes it as it is."""

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
    """On the write thread (nice 19): write a staged checkpoint over ``group``.

    ``process``: through DCP's process-based async save. Its writer process (one per rank, started on
    the first such save and kept for the run; gloo among the ranks' writers) is spawned from a thread
    this write thread starts, so it inherits nice 19; it maps the staged shared-memory buffers, and it
    is in the trainer's process group, so whatever ends the trainer's group ends it too. This thread
    waits for its result, so the write's future (finish's wait) means the same in both ways: the
    write is complete on every rank."""
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


def seal_checkpoint(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
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

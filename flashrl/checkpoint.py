"""Run checkpoints: one atomic folder per checkpoint, a ``latest`` pointer, and the resume checks.

    runs/<name>/checkpoints/
      step-40/                  one complete checkpoint (appears only when complete: tmp name, fsync, rename)
        trainer/                torch DCP: model + optimizer (+ critics) + torch RNG; trainer.json (version)
        controller.json         ControllerState (msgspec JSON): step, version, data position, counters, ...
        rollouts.msgpack        RolloutSnapshot (msgspec msgpack): the untrained groups and unfinished rollouts
        config.toml             the resolved config it was written under (resume refuses unsafe changes)
      step-50/
      latest                    "step-50": rewritten (tmp, fsync, rename) only after step-50/ is complete

Write order: ``step-N.tmp/`` -> trainer's DCP save into ``step-N.tmp/trainer`` (itself atomic) ->
controller.json + config.toml (fsync each) -> fsync the folder -> rename to ``step-N`` -> fsync the
parent -> ``latest`` -> delete the oldest beyond ``run.keep_checkpoints``. With trainer.checkpoint_async
(the default) the trainer's save only stages its state and training goes on while DCP writes; the
steps from controller.json on run once the trainer reports the write finished on every rank
(``CheckpointWriter``), so the order on disk is the same. A crash (SIGKILL, full disk) at any point leaves the previous checkpoint and ``latest`` untouched; a leftover ``step-N.tmp`` is
ignored by resume and removed by the next save of that step.

Rollouts generated but not yet trained (scheduler.stale = "partial", the default): every group
outstanding at the checkpoint is saved with its finished samples and its unfinished rollouts' prefixes
(tokens, behaviour logprobs, per-token versions), in ``rollouts.msgpack`` (``RolloutSnapshot``, its own
format number). The controller takes the cut between two steps: it stops every training rollout's
engine request (the engine answers with the tokens so far), lets no new one start, reads the buffer and
the prefixes and the data position in one synchronous step, then lets the rollouts continue from their
prefixes (controller/feed.py). A resumed run restores those groups under their own prompt uids (never
drawn again from the data) and continues each unfinished rollout from its prefix, so single-turn
rollouts regenerate nothing (``resume/regenerated_tokens`` = 0). A multi-turn rollout past its first
turn (its environment's state is not saved) restarts from scratch, its tokens counted in
``resume/regenerated_tokens``. In the other modes (drop, wait) nothing is saved but the uids: those
prompts are re-admitted first on resume, under the same prompt uids (so the same request seeds,
``scheduler.request_seed``), at most one buffer's worth of generation ((async_ratio + 1) *
batch_prompts groups). Either way every prompt uid is trained exactly once (or dropped, counted),
across any number of resumes. The data order needs no RNG state: uid u is epoch
``u // len(train split)``, position ``u % len``, of that epoch's seeded shuffle.

Resume (``prepare_resume``) happens before any process starts: the checkpoint is verified (JSON
decodes, DCP metadata reads, no data file shorter than the metadata says), the latest corrupt one is
skipped for the one before (logged, naming it), and a config change outside ``SAFE_TO_CHANGE`` is
refused naming the keys. Every problem is a ``CheckpointError``; the CLI prints it and exits 2.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from flashrl.wire.trajectory import Trajectory

log = logging.getLogger(__name__)

CONTROLLER_FILE = "controller.json"
ROLLOUTS_FILE = "rollouts.msgpack"
CONFIG_FILE = "config.toml"
TRAINER_DIR = "trainer"
LATEST = "latest"
FORMAT = 2  # 2: the untrained rollouts in ROLLOUTS_FILE (1, without them, is read too: its groups are re-admitted)
READS = (1, 2)
# 3: each rollout is the trajectory record itself (wire/trajectory.py; 1 and 2 saved the same fields under
# another name and decode as it); 2: SavedGroup.held (1, without it, is read too)
ROLLOUTS_FORMAT = 3
ROLLOUTS_READS = (1, 2, 3)
_STEP_RE = re.compile(r"^step-(\d+)$")

# Config keys a resumed run may change: how long, how often, how it is shown, where engines run and
# how many. Everything else changes what is trained (model, data, algorithm, batch shape) and is refused.
SAFE_TO_CHANGE = (
    "run.steps", "run.max_time_s", "run.eval_every", "run.eval_engines", "run.dashboard", "run.log_level", "run.checkpoint_every",
    "run.keep_checkpoints", "run.auto_resume", "run.name", "run.output_dir",
    "engine.count", "engine.device", "engine.kv_cache_gib", "engine.gpu_memory_utilization", "engine.max_num_seqs",
    "engine.threads", "engine.startup_timeout_s", "engine.heartbeat_s", "engine.max_restarts",
    "trainer.ranks", "trainer.threads", "trainer.micro_batch", "trainer.skip_inert", "trainer.checkpoint_async",
    "trainer.checkpoint_writer",
    "trainer.checkpoint_timeout_s", "weight_sync.", "cluster.",
    "rollout.turn_timeout_s", "rollout.trajectory_timeout_s", "rollout.max_retries", "scheduler.drain",
)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed from; the message names the file and the fix."""


class SavedGroup(msgspec.Struct, kw_only=True):
    """One group outstanding at the checkpoint: complete and waiting for the trainer, or still generating."""

    uid: int  # its prompt uid (the data position: DataStream.task_of(uid))
    task_id: str  # checked on resume against the task that uid gives
    complete: bool
    next_index: int  # the next sample index it would launch (indices seed requests, never reused)
    admitted_version: int
    completed_version: int = 0  # complete groups: the version when they completed (partial mode's bound)
    samples: list[Trajectory] = []  # finished samples, in the order they joined the group
    # one per rollout in flight (not complete groups): the prefix the cut took. ``turns`` 0 = cut inside its
    # first generation (the resumed run continues it from ``response_ids``), 1 = its generation came back
    # (``finish_reason``) and its environment step was running (the resumed run steps the environment with
    # it, generating nothing); no tokens = not started, or a multi-turn rollout past its first turn that
    # restarts from scratch
    unfinished: list[Trajectory] = []
    # finished samples not yet in ``samples``: each waits for an earlier-launched rollout of its group
    # (rollout.redundant_keep = "launch_order"); the resumed group tallies them before it runs anything
    held: list[Trajectory] = []


class RolloutSnapshot(msgspec.Struct, kw_only=True):
    """The untrained work of a run at a checkpoint (``rollouts.msgpack``).

    ``groups``: complete groups in completion order (the order batches take them), then the running ones
    by uid. ``regenerated_tokens``: tokens generated for outstanding groups that the snapshot does not
    keep (multi-turn rollouts past their first turn; every group outside partial mode, whose finished
    samples count here, but not the unknown progress of their requests in flight), which a resumed run
    generates again. ``unsettled``: requests the cut asked to stop that did not answer in time (their
    tokens since the previous cut are lost; 0 normally)."""

    format: int = ROLLOUTS_FORMAT
    version: int = 0  # the checkpoint's version (must equal ControllerState.version)
    groups: list[SavedGroup] = []
    regenerated_tokens: int = 0
    unsettled: int = 0


class ControllerState(msgspec.Struct, kw_only=True):
    """Everything the controller needs to continue a run exactly where a checkpoint left it."""

    format: int = FORMAT
    step: int  # steps trained (== policy version)
    version: int
    elapsed_s: float  # training time so far (run.max_time_s counts the whole run, across resumes)
    samples_trained: int = 0
    tokens_trained: int = 0
    seed: int = 0
    train_size: int = 0  # length of the train split (the data order is a function of seed and this)
    next_uid: int = 0  # the uid the next new prompt gets
    readmit: list[int] = []  # uids outstanding at the checkpoint: re-admitted first on resume
    dropped_uids: list[int] = []  # uids given up (dropped/groups_*): with the trained and readmitted ones, every uid < next_uid
    counters: dict[str, int] = {}
    env_counters: dict[str, float] = {}  # the environment suite's own counters (env/<name>), continued on resume
    env_state: dict[str, Any] = {}  # the suite's own state (flashrl.env.Stateful: a reward model's statistics)
    reward_history: list[tuple[int, float]] = []
    eval_history: list[tuple[int, float]] = []
    gap_history: list[tuple[int, float]] = []  # a reward model's or judge's reward minus the verifier's, per step
    latency_history: list[tuple[int, float]] = []  # their scoring latency per step, ms (the dashboard's curves)
    metrics_through: int = 0  # last step whose line is in metrics.jsonl
    pending_record: dict[str, Any] | None = None  # this step's record, not yet written (held or eval in flight)
    pending_eval: bool = False  # ... and it was waiting for its eval (resume evaluates the same weights)
    rollouts_file: str = ""  # ROLLOUTS_FILE when the checkpoint has one (format 2)
    # the untrained groups and unfinished rollouts: written to / read from ``rollouts_file``, never to
    # controller.json (None there)
    rollouts: RolloutSnapshot | None = None


_ENC = msgspec.json.Encoder()
_MP = msgspec.msgpack.Encoder()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint folders under ``root`` (``step-N``, not ``.tmp``), oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_latest(root: Path) -> Path | None:
    """The folder ``latest`` names, or None when there is no pointer."""
    ptr = root / LATEST
    if not ptr.exists():
        return None
    name = ptr.read_text().strip()
    if not _STEP_RE.match(name):
        raise CheckpointError(f"{ptr}: expected a line like 'step-40', found {name[:80]!r}; delete the file to "
                              "resume from the newest complete checkpoint")
    return root / name


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _encode(state: ControllerState) -> tuple[bytes, bytes | None]:
    """``state`` as the files a checkpoint writes: controller.json (naming the rollouts file, if any) and
    the rollouts snapshot (None: none saved), encoded at the request (the run goes on changing the state)."""
    if state.rollouts is None:
        return _ENC.encode(msgspec.structs.replace(state, rollouts_file="")), None
    head = msgspec.structs.replace(state, rollouts=None, rollouts_file=ROLLOUTS_FILE)
    return _ENC.encode(head), _MP.encode(state.rollouts)


class CheckpointWriter:
    """Writes ``step-N`` folders under ``root`` for one run (see the module docstring for the order).

    ``trainer`` is anything with ``async save_checkpoint(path)`` (trainer/client.TrainerGroup; the
    simulator's fakes). ``save`` raises CheckpointError, with the previous checkpoint intact, when
    anything fails (a full disk: OSError ENOSPC); the caller decides whether the run goes on.

    ``background`` (trainer.checkpoint_async; needs a trainer with ``finish_checkpoint``): ``save(state,
    wait=False)`` returns once the trainer has staged its state (the next step may then change it) and a
    task of this writer completes the checkpoint: it waits (at most ``timeout_s``) for the trainer's
    write to finish on every rank (``finish_checkpoint``: the trainer renames its folder into place only
    then), then writes controller.json + config.toml and renames ``step-N.tmp`` -> ``step-N`` and
    ``latest``, in the same order as a blocking save. So a checkpoint is complete, or it is not there:
    a crash mid-write leaves ``step-N.tmp`` and the previous ``latest``. ``on_done(path, error)`` hears
    how it ended (the ledger records the resume point only then). The controller's state is encoded
    when the save starts (the run goes on changing it). A save while one is in flight first waits for
    it (``last_wait_s``); ``close`` waits for the last one with a deadline.
    """

    def __init__(self, root: Path, trainer: Any, cfg_toml: str, keep: int, *, last_step: int | None = None,
                 background: bool = False, timeout_s: float = 300.0) -> None:
        self.root = Path(root)
        self.trainer = trainer
        self.cfg_toml = cfg_toml
        self.keep = max(1, keep)
        self.last_step = last_step  # the step of the newest complete checkpoint (resume: the one resumed from)
        self.background = background and hasattr(trainer, "finish_checkpoint")
        self.timeout_s = timeout_s
        self.saved = 0
        self.failed = 0
        self.seconds = 0.0  # total wall time the train loop spent in save() (the stall it sees)
        self.last_wait_s = 0.0  # the last save's wait for the write before it (time/ckpt_wait_s)
        self.write_s: list[float] = []  # each background write's whole duration, until taken (time/ckpt_write_s)
        self._inflight: Any = None  # asyncio.Task completing the background checkpoint in flight

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    async def save(self, state: ControllerState, *, wait: bool = True,
                   on_done: Callable[[Path | None, CheckpointError | None], None] | None = None) -> Path | None:
        """Write a checkpoint of ``state``; its folder, or None while it completes in the background
        (``wait=False`` with ``background``). A failure before the write is in flight raises
        CheckpointError (``on_done`` hears it too); one after, only ``on_done``."""
        import asyncio

        t0 = time.perf_counter()
        step = state.step
        final = step_dir(self.root, step)
        try:
            self.last_wait_s = await self.wait()
            if self.last_step == step and final.is_dir():
                # nothing trained since: the checkpoint of this step is already there; its untrained work
                # is replaced by the newer cut (a stop soon after a periodic checkpoint keeps what came since)
                if state.rollouts is not None:
                    try:
                        await asyncio.to_thread(self._refresh, final, state)
                    except OSError as e:
                        self.failed += 1
                        raise CheckpointError(f"checkpoint {final}: its rollouts not refreshed ({e}); it is intact, "
                                              "with the rollouts of its own time") from e
                return final
            tmp = self.root / f"step-{step}.tmp"
            data = _encode(state)  # now: the run goes on changing what ``state`` refers to
            try:
                await asyncio.to_thread(self._begin, tmp, final)
                if not self.background:
                    await self.trainer.save_checkpoint(tmp / TRAINER_DIR)
                    await asyncio.to_thread(self._finish, tmp, final, data)
                else:
                    await self.trainer.save_checkpoint(tmp / TRAINER_DIR, background=True)
            except Exception as e:
                err = await self._failed(tmp, final, e)
                if on_done is not None:
                    on_done(None, err)
                raise err from e
            if self.background:
                self._inflight = asyncio.create_task(self._complete(tmp, final, data, step, on_done),
                                                     name=f"checkpoint step-{step}")
                if not wait:
                    return None
                await self.wait()
                return final if self.last_step == step else None
            self._done(step)
            if on_done is not None:
                on_done(final, None)
            return final
        finally:
            self.seconds += time.perf_counter() - t0

    async def wait(self) -> float:
        """Wait for the background checkpoint in flight, if any (its outcome goes to its ``on_done``); the
        seconds waited. Cancelling the caller does not cancel the checkpoint (``close`` may)."""
        import asyncio

        task = self._inflight
        if task is None or task.done():
            return 0.0
        loop = asyncio.get_running_loop()  # the loop's clock (virtual in the simulator), as the step times
        t0 = loop.time()
        await asyncio.shield(task)
        return loop.time() - t0

    async def close(self, timeout_s: float | None = None) -> None:
        """At the run's end, on every path: wait (at most ``timeout_s``, default the write deadline) for the
        checkpoint in flight; past it the completion is cancelled and the checkpoint stays incomplete
        (``step-N.tmp``, never ``latest``)."""
        import asyncio

        task = self._inflight
        if task is None or task.done():
            return
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(task), limit)
        except TimeoutError:
            log.error("checkpoint write still in flight after %.0f s at the run's end: abandoned (incomplete, "
                      "not resumable; the previous checkpoint stays the latest)", limit)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    def take_write_s(self) -> float | None:
        """The background writes finished since the last call: their summed duration (None: none)."""
        if not self.write_s:
            return None
        out, self.write_s = sum(self.write_s), []
        return out

    async def _complete(self, tmp: Path, final: Path, data: tuple[bytes, bytes | None], step: int,
                        on_done: Callable[[Path | None, CheckpointError | None], None] | None) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await self.trainer.finish_checkpoint(tmp / TRAINER_DIR, self.timeout_s)
            await asyncio.to_thread(self._finish, tmp, final, data)
        except Exception as e:
            err = await self._failed(tmp, final, e)
            if on_done is not None:
                on_done(None, err)
            return
        self.write_s.append(loop.time() - t0)  # from the staged state to the sealed checkpoint
        self._done(step)
        if on_done is not None:
            on_done(final, None)

    def _done(self, step: int) -> None:
        self.saved += 1
        self.last_step = step

    async def _failed(self, tmp: Path, final: Path, e: Exception) -> CheckpointError:
        import asyncio

        self.failed += 1
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        prev = read_latest(self.root) if (self.root / LATEST).exists() else None
        keep = f"the previous checkpoint {prev} is intact" if prev else "there is no earlier checkpoint"
        return CheckpointError(f"checkpoint {final} not written ({type(e).__name__}: {e}); {keep}")

    def _begin(self, tmp: Path, final: Path) -> None:
        if final.exists():
            raise FileExistsError(f"{final} already exists (written by an earlier run under this name?)")
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier save of this step
        tmp.mkdir()

    def _finish(self, tmp: Path, final: Path, data: tuple[bytes, bytes | None]) -> None:
        head, rollouts = data
        # the rollouts go beside controller.json, inside the same folder: atomic with it (one rename)
        if rollouts is not None:
            _write_durable(tmp / ROLLOUTS_FILE, rollouts)
        _write_durable(tmp / CONTROLLER_FILE, head)
        _write_durable(tmp / CONFIG_FILE, self.cfg_toml.encode())
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(self.root)
        ptr_tmp = self.root / (LATEST + ".tmp")
        _write_durable(ptr_tmp, f"{final.name}\n".encode())
        os.replace(ptr_tmp, self.root / LATEST)
        fsync_dir(self.root)
        self._prune(final)

    def _refresh(self, final: Path, state: ControllerState) -> None:
        """Replace a complete checkpoint's controller state and rollouts (same step, same trainer state):
        the new rollouts under another name first, then controller.json naming them, renamed over the
        old one (atomic), then the old rollouts file goes. At every instant controller.json names a
        complete rollouts file."""
        old = msgspec.json.decode((final / CONTROLLER_FILE).read_bytes(), type=ControllerState).rollouts_file
        name = ROLLOUTS_FILE if old != ROLLOUTS_FILE else ROLLOUTS_FILE.replace(".msgpack", ".1.msgpack")
        _write_durable(final / name, _MP.encode(state.rollouts))
        head = msgspec.structs.replace(state, rollouts=None, rollouts_file=name)
        _write_durable(final / (CONTROLLER_FILE + ".tmp"), _ENC.encode(head))
        os.replace(final / (CONTROLLER_FILE + ".tmp"), final / CONTROLLER_FILE)
        fsync_dir(final)
        if old and old != name:
            (final / old).unlink(missing_ok=True)

    def _prune(self, newest: Path) -> None:
        done = list_checkpoints(self.root)
        for _, p in done[: max(0, len(done) - self.keep)]:
            if p != newest:
                shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- verify


def verify(path: Path) -> ControllerState:
    """Check that ``path`` is a complete, readable checkpoint; its ControllerState, or CheckpointError."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    cfile = path / CONTROLLER_FILE
    if not cfile.is_file():
        raise CheckpointError(f"{path}: not a flashrl checkpoint ({CONTROLLER_FILE} missing); "
                              "pass a runs/<name>/checkpoints/step-<N> folder or a run folder")
    try:
        state = msgspec.json.decode(cfile.read_bytes(), type=ControllerState)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CheckpointError(f"{cfile}: corrupt ({e})") from None
    if state.format not in READS:
        raise CheckpointError(f"{cfile}: checkpoint format {state.format}, this flashrl reads "
                              f"{', '.join(map(str, READS))}; resume it with the flashrl that wrote it")
    if state.rollouts_file:
        state.rollouts = read_rollouts(path / state.rollouts_file, state.version)
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path / CONFIG_FILE}: missing")
    _verify_dcp(path / TRAINER_DIR)
    return state


def read_rollouts(path: Path, version: int) -> RolloutSnapshot:
    """A checkpoint's ``rollouts.msgpack``; CheckpointError naming the file when it is missing, corrupt,
    of another format or of another version than its controller.json."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (controller.json names it: the checkpoint is incomplete)")
    try:
        snap = msgspec.msgpack.decode(path.read_bytes(), type=RolloutSnapshot)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CheckpointError(f"{path}: corrupt ({e})") from None
    if snap.format not in ROLLOUTS_READS:
        raise CheckpointError(
            f"{path}: rollouts format {snap.format}, this flashrl reads formats {', '.join(map(str, ROLLOUTS_READS))}: "
            f"resume it with the flashrl that wrote it, or start the run afresh (a new run.name, or without --resume)")
    if snap.version != version:
        raise CheckpointError(f"{path}: rollouts of version {snap.version}, its controller.json is at {version}")
    for g in snap.groups:
        for t in (*g.samples, *g.unfinished, *g.held):
            n = len(t.response_ids)
            if not (len(t.loss_mask) == len(t.behav_logp) == len(t.versions) == n) or t.group != g.uid:
                raise CheckpointError(f"{path}: corrupt (rollout {t.sample_id!r} of group {g.uid}: {n} tokens, "
                                      f"{len(t.loss_mask)} mask, {len(t.behav_logp)} logprobs, {len(t.versions)} versions)")
    return snap


def _verify_dcp(path: Path) -> None:
    """The trainer's DCP folder: metadata readable and every data file at least as long as it says."""
    meta_json = path / "trainer.json"
    if not meta_json.is_file():
        raise CheckpointError(f"{meta_json}: missing (the trainer's part of the checkpoint is incomplete)")
    try:
        msgspec.json.decode(meta_json.read_bytes())
    except msgspec.DecodeError as e:
        raise CheckpointError(f"{meta_json}: corrupt ({e})") from None
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # DCP's own format; a truncated file fails inside its reader
        raise CheckpointError(f"{path / '.metadata'}: unreadable ({type(e).__name__}: {e})") from None
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel, end in sorted(need.items()):
        f = path / rel
        size = f.stat().st_size if f.is_file() else -1
        if size < end:
            what = "missing" if size < 0 else f"truncated: {size} bytes, the metadata needs {end}"
            raise CheckpointError(f"{f}: {what}")

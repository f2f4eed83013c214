"""Unfinished rollouts across a checkpoint (scheduler.stale = "partial"): the snapshot's format, the
cut's consistency with the data position, and `--resume` continuing them instead of regenerating.

On fakes and virtual time (tests/unit/test_checkpoint.py's Run harness: the controller, the checkpoint
writer, metrics.jsonl and prepare_resume, as `flashrl run --resume` wires them, without processes).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl.checkpoint import (
    ROLLOUTS_FILE,
    ROLLOUTS_FORMAT,
    CheckpointError,
    CheckpointWriter,
    ControllerState,
    RolloutSnapshot,
    SavedGroup,
    list_checkpoints,
    verify,
)
from flashrl.controller.context import RolloutContext
from flashrl.controller.cut import CheckpointCut
from flashrl.controller.group import _GroupState, run_group
from flashrl.controller.scheduler import DataStream, Router
from flashrl.controller.types import Trajectory
from flashrl.metrics import read_jsonl
from flashrl.resuming import find_checkpoint, prepare_folder, prepare_resume
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import FakeEngine, FakeSuite, FakeTokenizer, FakeTrainer
from flashrl.wire.trajectory import NOT_SAVED, snapshot
from tests.unit.test_checkpoint import Run, config, epoch_check

# ------------------------------------------------------------------------------------------- the format


def test_a_checkpoint_keeps_the_trajectory_record_but_its_timings() -> None:
    """The checkpoint saves the one trajectory record (wire/trajectory.py), no second field list: a
    snapshot is a copy with the NOT_SAVED fields back at their defaults, every other field kept."""
    t = Trajectory(sample_id="3-1", group=3, index=1, prompt_ids=[1, 2], response_ids=[5, 6, 7], loss_mask=[1, 1, 1],
                   behav_logp=[-0.1, -0.2, -0.3], versions=[4, 4, 5], reward=1.0, correct=True, finish_reason="stop",
                   turns=1, engine="e0", attempts=2, version_sent=4, task_id="t3", metrics={"m": 1.5}, restored=1,
                   top_logprobs=[[(5, -0.1), (9, -2.0)], [(6, -0.2), (1, -3.0)], [(7, -0.3), (2, -1.5)]],
                   t_start=1.0, t_end=2.0, gen_s=0.5, status="failed", failure="x")
    s = snapshot(t)
    t.response_ids += [9]  # the rollout goes on after the cut: the snapshot keeps what it had
    t.metrics["m"] = 2.0
    assert s.response_ids == [5, 6, 7] and s.metrics == {"m": 1.5}
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Trajectory)
    blank = Trajectory(group=0)
    for f in Trajectory.__struct_fields__:
        want = getattr(blank, f) if f in NOT_SAVED else getattr(s, f)
        assert getattr(back, f) == want, f
    assert back.version_start == 4 and back.restored == 1 and back.attempts == 2 and back.t_start == 0.0
    assert back.top_logprobs[2] == [(7, -0.3), (2, -1.5)]


# A rollout as formats 1 and 2 saved it (checkpoint.SavedRollout, before the one record): these fields only.
FORMAT_2_ROLLOUT = dict(sample_id="7-0", group=7, index=0, prompt_ids=[1], response_ids=[3, 4], loss_mask=[1, 1],
                        behav_logp=[-1.0, -2.0], versions=[1, 2], reward=0.0, correct=False, finish_reason="",
                        turns=0, engine="e1", attempts=1, version_sent=1, task_id="t7", metrics={}, restored=0,
                        template_mismatch=-1, retokenize_mismatch=-1)


def test_a_format_2_rollouts_file_still_resumes_and_an_unknown_format_names_the_fix(tmp_path: Path) -> None:
    state = ControllerState(step=2, version=2, elapsed_s=1.0, rollouts=_snapshot())
    path = run_virtual(lambda: _save(tmp_path, state)).result
    rfile = path / ROLLOUTS_FILE
    assert msgspec.msgpack.decode(rfile.read_bytes())["format"] == ROLLOUTS_FORMAT == 3
    old = {"format": 2, "version": 2, "regenerated_tokens": 3, "unsettled": 0, "groups": [
        {"uid": 7, "task_id": "t7", "complete": False, "next_index": 2, "admitted_version": 1, "completed_version": 0,
         "samples": [], "unfinished": [FORMAT_2_ROLLOUT], "held": []}]}
    rfile.write_bytes(msgspec.msgpack.encode(old))
    snap = verify(path).rollouts
    assert snap is not None and snap.format == 2
    (t,) = snap.groups[0].unfinished
    assert t == Trajectory(**FORMAT_2_ROLLOUT)  # every field it saved, the newer ones at their defaults
    assert t.top_logprobs == [] and t.version_start == 1
    rfile.write_bytes(msgspec.msgpack.encode({**old, "format": 4}))
    with pytest.raises(CheckpointError, match=r"rollouts format 4, this flashrl reads formats 1, 2, 3: resume it "
                                              r"with the flashrl that wrote it, or start the run afresh"):
        verify(path)


def _snapshot(version: int = 2) -> RolloutSnapshot:
    r = Trajectory(sample_id="7-0", group=7, index=0, prompt_ids=[1], response_ids=[3, 4], loss_mask=[1, 1],
                   behav_logp=[-1.0, -2.0], versions=[1, 2])
    return RolloutSnapshot(version=version, groups=[
        SavedGroup(uid=7, task_id="t7", complete=False, next_index=2, admitted_version=1, unfinished=[r]),
    ], regenerated_tokens=3)


async def _save(tmp: Path, state: ControllerState) -> Path:
    return await CheckpointWriter(tmp, FakeTrainer(), "", 3).save(state)


def test_snapshot_round_trip_and_every_bad_file_named(tmp_path: Path) -> None:
    state = ControllerState(step=2, version=2, elapsed_s=1.0, rollouts=_snapshot())
    path = run_virtual(lambda: _save(tmp_path, state)).result
    head = msgspec.json.decode((path / "controller.json").read_bytes())
    assert head["rollouts"] is None and head["rollouts_file"] == ROLLOUTS_FILE and head["format"] == 2
    assert verify(path).rollouts == _snapshot()  # msgpack beside the JSON, read back whole

    rfile = path / ROLLOUTS_FILE
    good = rfile.read_bytes()
    rfile.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(CheckpointError, match=rf"{rfile}: corrupt"):
        verify(path)
    rfile.write_bytes(msgspec.msgpack.encode(_snapshot(version=1)))
    with pytest.raises(CheckpointError, match=r"rollouts of version 1, its controller.json is at 2"):
        verify(path)
    rfile.write_bytes(msgspec.msgpack.encode(msgspec.structs.replace(_snapshot(), format=9)))
    with pytest.raises(CheckpointError, match=r"rollouts format 9, this flashrl reads formats 1, 2, 3"):
        verify(path)
    bad = _snapshot()
    bad.groups[0].unfinished[0].versions = [1]  # one version short of its tokens
    rfile.write_bytes(msgspec.msgpack.encode(bad))
    with pytest.raises(CheckpointError, match=r"rollout '7-0' of group 7: 2 tokens, 2 mask, 2 logprobs, 1 versions"):
        verify(path)
    rfile.unlink()
    with pytest.raises(CheckpointError, match=rf"{rfile}: missing"):
        verify(path)


def test_a_format_1_checkpoint_still_resumes_and_a_newer_format_is_refused(tmp_path: Path) -> None:
    path = run_virtual(lambda: _save(tmp_path, ControllerState(step=2, version=2, elapsed_s=1.0))).result
    cfile = path / "controller.json"
    old = msgspec.json.decode(cfile.read_bytes())
    old["format"] = 1
    del old["rollouts_file"], old["rollouts"]
    cfile.write_bytes(msgspec.json.encode(old))
    assert verify(path).rollouts is None  # format 1: no rollouts, its outstanding groups are re-admitted
    cfile.write_bytes(msgspec.json.encode({**old, "format": 3}))
    with pytest.raises(CheckpointError, match=r"checkpoint format 3, this flashrl reads 1, 2"):
        verify(path)


# ------------------------------------------------------------------------------------------- the cut


class StepEngine(FakeEngine):
    """Answers an abort at its next step, 0.25 s later (vLLM applies one between two steps)."""

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        events = [self._wake[r] for r in request_ids if r in self._wake]
        asyncio.get_running_loop().call_later(0.25, lambda: [ev.set() for ev in events])


def test_a_cut_folds_the_tokens_so_far_and_the_rollout_goes_on_from_them() -> None:
    """RolloutContext.cut mid-generation: the request is aborted, its tokens so far (with the engine's
    logprobs and versions) are in the registered Trajectory when cut() returns, no request starts until
    go_on(); then the rollout asks for the rest (prompt + prefix, max_tokens less it, another seed) and
    its sample is the prefix followed by the continuation, each token with the version that made it."""
    cfg = config(Path("/nonexistent"), rollout={"max_new_tokens": 10}, model={"max_model_len": 64})
    eng = StepEngine("e0", lambda req, v: ([ord("5")] * req.max_tokens, float(req.max_tokens)))  # 1 s a token
    suite = FakeSuite(n_train=1)
    ctx = RolloutContext(cfg=cfg, tokenizer=FakeTokenizer(), suite=suite, engines=[eng], router=Router(1, 8),
                         version=lambda: 0, cut=CheckpointCut([eng], Counter()))
    out: list[Trajectory] = []
    seen: dict[str, Any] = {}

    async def main() -> None:
        task = suite.train_tasks()[0]
        g = asyncio.get_running_loop().create_task(run_group(ctx, task=task, group=0, need=1, first_index=0, extra=0,
                                                             temperature=1.0, on_sample=out.append))
        await anyio.sleep(3.5)
        assert await ctx.cut.cut() == 0
        _, _, t = ctx.cut.rollouts["0-0"]
        assert t is not None
        seen["prefix"] = (list(t.response_ids), list(t.behav_logp), list(t.versions))
        await anyio.sleep(5.0)  # the gate is closed: nothing generates meanwhile
        seen["requests"] = len(eng.requests)
        eng.version = 1  # (as a weight update would: the continuation's tokens are of version 1)
        eng._history.append((anyio.current_time(), 1))
        ctx.cut.go_on()
        await g

    run_virtual(main)
    ids, lps, vs = seen["prefix"]
    assert ids == [ord("5")] * 3 and len(lps) == 3 and vs == [0, 0, 0] and seen["requests"] == 1
    first, second = eng.requests
    assert eng.aborted == [first.request_id] and second.request_id == first.request_id + ".1"
    assert second.prompt_ids == first.prompt_ids + ids and second.max_tokens == 7 and second.seed != first.seed
    (t,) = out
    assert t.response_ids == [ord("5")] * 10 and t.loss_mask == [1] * 10 and t.finish_reason == "length"
    assert t.behav_logp[:3] == lps and t.versions == [0, 0, 0] + [1] * 7
    assert not ctx.cut.rollouts and not ctx.cut.tracked and not ctx.cut.interrupts  # nothing left registered


# ------------------------------------------------------------------------------------------- the runs


def tail_script(req: Any, version: int) -> tuple[list[int], float]:
    """Lengths 1..max_tokens, one response in four slow (0.5-1 s a token): rollouts are in flight, with
    tokens, at every checkpoint."""
    rng = random.Random(req.seed)
    n = rng.randint(1, req.max_tokens)
    per_token = rng.uniform(0.5, 1.0) if rng.random() < 0.25 else rng.uniform(0.02, 0.1)
    return [ord(rng.choice("0123456789")) for _ in range(n)], n * per_token


def partial_cfg(tmp: Path, *, steps: int = 16, ratio: int = 2, batch: int = 2, group: int = 3, redundancy: int = 0,
                every: int = 3, turns: int = 1, seed: int = 1) -> Any:
    return config(tmp, run={"steps": steps, "seed": seed, "eval_every": 0, "checkpoint_every": every},
                  rollout={"group_size": group, "batch_prompts": batch, "max_new_tokens": 8, "redundancy": redundancy,
                           "max_turns": turns},
                  scheduler={"async_ratio": ratio, "queue_scheduling": True, "stale": "partial"})


def every_uid_once(run: Run, uids: list[int]) -> None:
    """No prompt trained twice or lost: every uid the data stream handed out (across the resumes) was
    trained exactly once, or is still outstanding at the end, or was dropped (counted)."""
    assert len(uids) == len(set(uids)), "a prompt uid was trained twice"
    c = run.controller
    left = set(c.buffer.groups) | set(c.stream.pending_readmit)
    assert not left & set(uids), "a prompt trained and still outstanding"
    assert set(uids) | left | set(c.buffer.dropped_uids) == set(range(c.stream.uid)), "a prompt was lost"


def snapshot_prefixes(snap: RolloutSnapshot) -> dict[str, Trajectory]:
    return {t.sample_id: t for g in snap.groups for t in g.unfinished if t.response_ids}


def test_stopped_with_rollouts_in_flight_resume_continues_them_and_regenerates_nothing(tmp_path: Path) -> None:
    """Stop (as on SIGTERM) with rollouts in flight; `--resume` restores every untrained group under its
    own uid, continues each unfinished rollout from its saved prefix (the tokens, behaviour logprobs and
    versions trained are the saved ones, then the continuation), regenerates no token, and every prompt
    of every epoch is trained exactly once."""
    cfg = partial_cfg(tmp_path)
    suite = lambda: FakeSuite(n_train=5, turns=1)  # noqa: E731
    first = Run(cfg, suite(), stop_at_s=8.0, script=tail_script)
    s1 = first.go()
    assert s1.stop_reason == "interrupted" and 2 < s1.steps < 16
    r = prepare_resume(cfg)
    snap = r.state.rollouts
    assert snap is not None and snap.version == s1.steps and snap.regenerated_tokens == 0
    prefixes = snapshot_prefixes(snap)
    assert prefixes, "no rollout had tokens at the stop: the test shows nothing"
    assert not set(r.state.readmit) & {g.uid for g in snap.groups}  # a saved group is never also redrawn

    second = Run(cfg, suite(), resume=r, script=tail_script)
    s2 = second.go()
    assert s2.steps == 16 and s2.resumed_from == s1.steps
    c = s2.counters
    assert c["resume/restored_rollouts"] == sum(len(g.unfinished) for g in snap.groups) > 0
    assert c["resume/restored_groups"] == len(snap.groups)
    assert c["resume/restored_tokens"] >= sum(len(t.response_ids) for t in prefixes.values()) > 0
    assert c["resume/regenerated_tokens"] == 0 and c.get("resume/readmitted_groups", 0) == 0
    assert "stale/over_bound_groups" not in c and c.get("stale/dropped_samples", 0) == 0

    # each continued rollout: trained with its saved prefix first, then the rest; the engine got prompt + prefix
    trained = {x.sample_id: x for b in second.trainer.batches for x in b.samples}
    continued = [sid for sid in prefixes if sid in trained]
    assert continued
    for sid in continued:
        p, t = prefixes[sid], trained[sid]
        n = len(p.response_ids)
        assert t.response_ids[:n] == p.response_ids and t.behav_logp[:n] == p.behav_logp and t.versions[:n] == p.versions
        assert min(t.versions[n:], default=s1.steps) >= s1.steps  # the rest by the resumed weights
    asked = [q for e in second.engines for q in e.requests if q.request_id.startswith(tuple(f"{s}." for s in continued))]
    assert any(len(q.prompt_ids) > 3 and q.max_tokens < 8 for q in asked)  # prompt + prefix, fewer tokens to go

    records = [x for x in first.records if x["step"] <= r.state.metrics_through] + second.records
    uids = [u for x in records for u in x.get("prompt_uids", [])]
    every_uid_once(second, uids)
    epoch_check(DataStream(suite().train_tasks(), 1), uids, epochs=3)
    lines = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert [x["step"] for x in lines] == list(range(1, 17))
    assert lines[-1]["count/resume/regenerated_tokens"] == 0 and lines[-1]["count/resume/restored_rollouts"] > 0


def test_multi_turn_rollouts_past_their_first_turn_restart_and_are_counted(tmp_path: Path) -> None:
    """A rollout past its first turn (its environment's state is not saved) restarts from scratch on
    resume: its tokens are counted in resume/regenerated_tokens; its group and its other rollouts are
    still restored, and every prompt is trained exactly once."""
    cfg = partial_cfg(tmp_path, turns=3, steps=12)
    suite = lambda: FakeSuite(n_train=5, turns=3)  # noqa: E731
    first = Run(cfg, suite(), stop_at_s=12.0, script=tail_script)
    s1 = first.go()
    r = prepare_resume(cfg)
    assert r.state.rollouts is not None and r.state.rollouts.regenerated_tokens > 0
    second = Run(cfg, suite(), resume=r, script=tail_script)
    s2 = second.go()
    assert s2.steps == 12 and s1.steps < 12
    assert s2.counters["resume/regenerated_tokens"] == r.state.rollouts.regenerated_tokens
    assert s2.counters["resume/restored_groups"] > 0
    records = [x for x in first.records if x["step"] <= r.state.metrics_through] + second.records
    every_uid_once(second, [u for x in records for u in x.get("prompt_uids", [])])


def test_a_stop_right_after_a_periodic_checkpoint_refreshes_its_rollouts(tmp_path: Path) -> None:
    """The stop's checkpoint is of the same step as the periodic one just written: the trainer state is
    not written again, but the rollouts (and controller.json naming them) are replaced atomically by the
    stop's cut, so nothing generated in between is lost."""
    cfg = partial_cfg(tmp_path, every=1, steps=40)
    run = Run(cfg, FakeSuite(n_train=5), stop_at_s=6.0, script=tail_script)
    run.go()
    root = cfg.run_dir / "checkpoints"
    path = list_checkpoints(root)[-1][1]
    before = verify(path)
    assert before.rollouts is not None
    state = run.controller.state(None, (msgspec.structs.replace(before.rollouts, regenerated_tokens=5), []))
    state.rollouts_file = before.rollouts_file
    run.ckpt.last_step = state.step
    run_virtual(lambda: run.ckpt.save(state))
    after = verify(path)
    assert after.rollouts is not None and after.rollouts.regenerated_tokens == 5
    assert after.rollouts_file != before.rollouts_file and not (path / before.rollouts_file).exists()
    assert sorted(p.name for p in path.iterdir()) == sorted(["config.toml", "controller.json", "trainer", after.rollouts_file])


@settings(max_examples=12, deadline=None)
@given(ratio=st.integers(0, 2), batch=st.integers(1, 3), group=st.integers(1, 3), redundancy=st.integers(0, 1),
       every=st.integers(1, 4), seed=st.integers(0, 1000), stops=st.lists(st.floats(1.0, 8.0), min_size=1, max_size=3),
       crash=st.booleans())
def test_no_prompt_trained_twice_or_lost_across_stops_and_crashes(
        tmp_path_factory: pytest.TempPathFactory, ratio: int, batch: int, group: int, redundancy: int, every: int,
        seed: int, stops: list[float], crash: bool) -> None:
    """Property: stopped (SIGTERM) or crashed (resumed from the periodic checkpoint before the last one)
    any number of times with rollouts in flight, a partial-mode run trains every prompt of every epoch
    exactly once, regenerates no token of a single-turn rollout, and never trains a group past the
    bound (stale/over_bound_groups)."""
    tmp = tmp_path_factory.mktemp("p")
    steps = 14
    cfg = partial_cfg(tmp, steps=steps, ratio=ratio, batch=batch, group=group, redundancy=redundancy, every=every,
                      seed=seed)
    n_train = 5
    suite = lambda: FakeSuite(n_train=n_train)  # noqa: E731
    records: list[dict[str, Any]] = []
    resume = None
    for k, at in enumerate([*stops, None]):
        run = Run(cfg, suite(), resume=resume, stop_at_s=at, script=tail_script)
        summary = run.go()
        keep = resume.state.metrics_through if resume is not None else -1
        records = [x for x in records if x["step"] <= keep] + run.records
        if summary.steps == steps:
            break
        if not list_checkpoints(cfg.run_dir / "checkpoints"):  # stopped before its first step: start again
            records, resume = [], None
            continue
        resume = find_checkpoint(cfg.run_dir)
        if crash and k == 0:  # as if the run had died after its previous checkpoint: resume that one
            older = [p for n, p in list_checkpoints(cfg.run_dir / "checkpoints") if n < resume.step]
            if older:
                resume = find_checkpoint(cfg.run_dir, older[-1])
                prepare_folder(cfg.run_dir / "checkpoints", resume)
        assert resume.state.rollouts is not None and resume.state.rollouts.regenerated_tokens == 0
        assert not set(resume.state.readmit) & {g.uid for g in resume.state.rollouts.groups}
    else:
        run = Run(cfg, suite(), resume=resume, script=tail_script)
        summary = run.go()
        records = [x for x in records if x["step"] <= resume.state.metrics_through] + run.records
    assert summary.steps == steps
    c = summary.counters
    assert c.get("resume/regenerated_tokens", 0) == 0 and "stale/over_bound_groups" not in c
    uids = [u for x in records for u in x.get("prompt_uids", [])]
    every_uid_once(run, uids)
    assert sorted(x["step"] for x in records if "prompt_uids" in x) == list(range(1, steps + 1))


class LateEngine(FakeEngine):
    """Finds nothing to abort the first time it is asked (the request had not reached it yet)."""

    asked = 0

    async def abort(self, request_ids: list[str]) -> None:
        self.asked += 1
        if self.asked > 1:
            await super().abort(request_ids)


def test_a_cut_asks_again_when_its_first_abort_found_nothing() -> None:
    cfg = config(Path("/nonexistent"), rollout={"max_new_tokens": 10}, model={"max_model_len": 64})
    eng = LateEngine("e0", lambda req, v: ([ord("5")] * req.max_tokens, float(req.max_tokens)))
    suite = FakeSuite(n_train=1)
    ctx = RolloutContext(cfg=cfg, tokenizer=FakeTokenizer(), suite=suite, engines=[eng], router=Router(1, 8),
                         version=lambda: 0, cut=CheckpointCut([eng], Counter()))
    seen: dict[str, Any] = {}

    async def main() -> None:
        g = asyncio.get_running_loop().create_task(run_group(ctx, task=suite.train_tasks()[0], group=0, need=1,
                                                             first_index=0, extra=0, temperature=1.0,
                                                             on_sample=lambda t: None))
        await anyio.sleep(2.2)
        t0 = anyio.current_time()
        assert await ctx.cut.cut() == 0
        seen["cut_s"] = anyio.current_time() - t0
        _, _, t = ctx.cut.rollouts["0-0"]
        seen["prefix"] = len(t.response_ids) if t is not None else None
        ctx.cut.go_on()
        await g

    run_virtual(main)
    assert seen["cut_s"] == pytest.approx(0.5) and seen["prefix"] == 2  # not the request's 7.8 s left
    assert eng.asked == 2 and eng.aborted == [eng.requests[0].request_id]


def test_a_restored_group_past_the_bound_is_readmitted_and_counted(tmp_path: Path) -> None:
    """Partial mode's bound (trained step - completion version <= async_ratio) holds for restored groups: one
    that could no longer meet it at the checkpoint's version (never, in a checkpoint flashrl wrote: here
    edited so) is re-admitted instead, counted (resume/over_bound_groups) with its tokens in
    resume/regenerated_tokens, and trained once like every other prompt."""
    cfg = partial_cfg(tmp_path)
    first = Run(cfg, FakeSuite(n_train=5), stop_at_s=8.0, script=tail_script)
    first.go()
    r = prepare_resume(cfg)
    assert r.state.rollouts is not None
    done = [g for g in r.state.rollouts.groups if g.complete]
    assert done, "no complete group at the stop: the test shows nothing"
    late = done[0]
    late.completed_version = r.state.version - 3  # async_ratio 2: too old for the next step
    second = Run(cfg, FakeSuite(n_train=5), resume=r, script=tail_script)
    s2 = second.go()
    c = s2.counters
    assert c["resume/over_bound_groups"] == 1 and c["resume/readmitted_groups"] == 1
    assert c["resume/regenerated_tokens"] == sum(len(t.response_ids) for t in late.samples) > 0
    assert c["resume/restored_groups"] == len(r.state.rollouts.groups) - 1 and "stale/over_bound_groups" not in c
    records = [x for x in first.records if x["step"] <= r.state.metrics_through] + second.records
    uids = [u for x in records for u in x.get("prompt_uids", [])]
    assert late.uid in uids
    every_uid_once(second, uids)


# ------------------------------------------------------------------------------------------- launch order


def by_index_script(slow: Any) -> Any:
    """Sample index ``k`` (from the request id ``uid-k.attempt.turn``) generates its 8 tokens slowly (1 s a
    token) when ``slow(k)``, else at once (0.05 s a token)."""

    def script(req: Any, version: int) -> tuple[list[int], float]:
        k = int(req.request_id.split(".")[0].split("-")[1])
        n = req.max_tokens
        return [ord(str(k % 10))] * n, n * (1.0 if slow(k) else 0.05)

    return script


def test_a_resumed_launch_order_group_with_a_gap_in_its_indices_decides() -> None:
    """rollout.redundant_keep = "launch_order", resumed: a group's restored rollouts carry the indices they had
    (0 and 2: index 1 finished before the checkpoint), its fresh ones start at its old next index (3). Each
    result goes to its own launch position (a slot of ``traj.index - first_index`` wrapped -3 onto 0 and 3
    onto 0 too: one slot never filled, the group never decided), and the kept samples are the first ``need``
    ok ones in launch order: 0 and 2, though 3 finished first."""
    cfg = config(Path("/nonexistent"), rollout={"max_new_tokens": 8, "redundancy": 1, "redundant_keep": "launch_order"},
                 model={"max_model_len": 64})
    eng = FakeEngine("e0", by_index_script(lambda k: k < 3))
    suite = FakeSuite(n_train=1)
    ctx = RolloutContext(cfg=cfg, tokenizer=FakeTokenizer(), suite=suite, engines=[eng], router=Router(1, 8),
                         version=lambda: 0)
    task = suite.train_tasks()[0]
    resumes = [Trajectory(sample_id=f"0-{k}", group=0, index=k, prompt_ids=FakeTokenizer().encode(task.prompt))
               for k in (0, 2)]
    out: list[Trajectory] = []

    async def main() -> bool:
        async with asyncio.timeout(60):  # virtual seconds: the group needs 8
            return await run_group(ctx, task=task, group=0, need=2, first_index=3, extra=1, temperature=1.0,
                                   on_sample=out.append, resumes=resumes)

    assert run_virtual(main).result is True
    assert [t.index for t in out] == [0, 2]
    assert ctx.counters["rollout/aborted_redundant"] == 0  # 3 had finished: nothing left to abort


def test_group_state_slots_are_launch_positions_of_restored_indices() -> None:
    """The issue's repro (need 2 of 3, restored indices 0 and 2, fresh 3): before, slots were ``index - 3``
    (0 and 3 both on slot 0): kept 1, never decided. Now every index has its own launch position; an index
    outside the group's is a bug, named."""
    out: list[Trajectory] = []

    async def main() -> None:
        cut = CheckpointCut([], Counter())
        held = cut.held
        st = _GroupState(2, 3, out.append, asyncio.get_running_loop().create_future(), [0, 2, 3], cut)
        st.finish(Trajectory(sample_id="0-3", group=0, index=3))
        assert set(held) == {"0-3"} and out == []  # waits for 0 and 2
        st.finish(Trajectory(sample_id="0-0", group=0, index=0))
        assert not st.decided.done() and [t.index for t in out] == [0]
        st.finish(Trajectory(sample_id="0-2", group=0, index=2))
        assert st.decided.done() and st.kept == 2 and [t.index for t in out] == [0, 2] and held == {}
        bad = _GroupState(1, 2, out.append, asyncio.get_running_loop().create_future(), [0, 2])
        with pytest.raises(RuntimeError, match=r"index 1 is not one launch position of its group's \(\[0, 2\]\)"):
            bad.finish(Trajectory(sample_id="0-1", group=0, index=1))

    run_virtual(main)


def held_back_cfg(tmp: Path, **over: Any) -> Any:
    return config(tmp, run={"steps": 4, "seed": 1, "eval_every": 0, "checkpoint_every": 1},
                  rollout={"group_size": 2, "batch_prompts": 1, "max_new_tokens": 8, "redundancy": 1,
                           "redundant_keep": "launch_order", **over.get("rollout", {})},
                  scheduler={"async_ratio": 1, "queue_scheduling": True, "stale": "partial"})


def go_within(run: Run, seconds: float) -> Any:
    """Run.go with a deadline (virtual seconds): a group that never decides fails the test, never hangs it."""
    async def main() -> Any:
        if run.stop_at_s is not None:
            asyncio.get_running_loop().call_later(run.stop_at_s, run.controller.request_stop)
        async with asyncio.timeout(seconds):
            return await run.controller.run()

    try:
        return run_virtual(main).result
    finally:
        run.writer.close()


def test_a_finished_sample_held_back_behind_an_earlier_launch_is_in_the_checkpoint_and_resumes(tmp_path: Path) -> None:
    """launch_order, partial, a checkpoint while index 1 has finished but waits for index 0 (still generating):
    the snapshot keeps index 1 with its group (``held``), not lost between the rollouts and the samples; the
    resumed run delivers 0 and 1 (launch order), launches no fresh rollout it does not need, trains every
    step once and regenerates nothing."""
    cfg = held_back_cfg(tmp_path)
    script = by_index_script(lambda k: k % 2 == 0)  # 0 and 2 slow, 1 fast: 1 is held back behind 0
    suite = lambda: FakeSuite(n_train=5)  # noqa: E731
    first = Run(cfg, suite(), stop_at_s=12.0, script=script, engines=1)  # steps 1, 2 at ~8.5 s
    s1 = go_within(first, 600)
    assert s1.stop_reason == "interrupted" and s1.steps < 4
    r = prepare_resume(cfg)
    snap = r.state.rollouts
    assert snap is not None
    running = [g for g in snap.groups if not g.complete]
    assert running, "no group generating at the stop: the test shows nothing"
    g0 = running[0]
    assert [t.index for t in g0.held] == [1] and [t.index for t in g0.unfinished] == [0, 2] and g0.samples == []
    assert g0.held[0].response_ids == [ord("1")] * 8 and g0.held[0].finish_reason

    second = Run(cfg, suite(), resume=r, script=script, engines=1)
    s2 = go_within(second, 600)
    assert s2.steps == 4
    trained = {x.sample_id: x for b in second.trainer.batches for x in b.samples}
    assert f"{g0.uid}-0" in trained and f"{g0.uid}-1" in trained and f"{g0.uid}-2" not in trained
    assert trained[f"{g0.uid}-1"].response_ids == g0.held[0].response_ids
    assert not [q for q in second.engines[0].requests if q.request_id.startswith(f"{g0.uid}-1.")]  # not again
    assert s2.counters["resume/regenerated_tokens"] == 0
    records = [x for x in first.records if x["step"] <= r.state.metrics_through] + second.records
    every_uid_once(second, [u for x in records for u in x.get("prompt_uids", [])])


def mixed_script(req: Any, version: int) -> tuple[list[int], float]:
    """tail_script, with every even sample index slow: later launches finish first, so launch order holds
    finished samples back at most cuts."""
    ids, s = tail_script(req, version)
    k = int(req.request_id.split(".")[0].split("-")[1])
    return ids, s * (4.0 if k % 2 == 0 else 0.5)


@settings(max_examples=16, deadline=None)
@given(redundancy=st.integers(0, 2), keep=st.sampled_from(["finish_order", "launch_order"]),
       stale=st.sampled_from(["partial", "drop", "wait"]), group=st.integers(1, 3), batch=st.integers(1, 2),
       every=st.integers(1, 3), seed=st.integers(0, 1000), stops=st.lists(st.floats(1.0, 10.0), min_size=1, max_size=3),
       crash=st.booleans())
def test_no_prompt_trained_twice_or_lost_nothing_hangs_for_any_keep_rule_and_stale_mode(
        tmp_path_factory: pytest.TempPathFactory, redundancy: int, keep: str, stale: str, group: int, batch: int,
        every: int, seed: int, stops: list[float], crash: bool) -> None:
    """Property: over redundancy x rollout.redundant_keep x scheduler.stale x where the run stops (SIGTERM) or
    crashes (resumed from the checkpoint before its last), every run and resume ends within its deadline,
    every step is trained once and every prompt uid once (or dropped, counted), and partial mode's
    single-turn rollouts regenerate no token."""
    tmp = tmp_path_factory.mktemp("p")
    steps = 10
    cfg = config(tmp, run={"steps": steps, "seed": seed, "eval_every": 0, "checkpoint_every": every},
                 rollout={"group_size": group, "batch_prompts": batch, "max_new_tokens": 8, "redundancy": redundancy,
                          "redundant_keep": keep},
                 scheduler={"async_ratio": 1, "queue_scheduling": True, "stale": stale})
    suite = lambda: FakeSuite(n_train=5)  # noqa: E731
    records: list[dict[str, Any]] = []
    resume = None
    summary = None
    for k, at in enumerate([*stops, None]):
        run = Run(cfg, suite(), resume=resume, stop_at_s=at, script=mixed_script)
        summary = go_within(run, 3000)  # virtual seconds; a run of 10 steps needs < 300
        keep_through = resume.state.metrics_through if resume is not None else -1
        records = [x for x in records if x["step"] <= keep_through] + run.records
        if summary.steps == steps:
            break
        if not list_checkpoints(cfg.run_dir / "checkpoints"):  # stopped before its first step: start again
            records, resume = [], None
            continue
        resume = find_checkpoint(cfg.run_dir)
        if crash and k == 0:
            older = [p for n, p in list_checkpoints(cfg.run_dir / "checkpoints") if n < resume.step]
            if older:
                resume = find_checkpoint(cfg.run_dir, older[-1])
                prepare_folder(cfg.run_dir / "checkpoints", resume)
    assert summary is not None and summary.steps == steps
    if stale == "partial":
        assert summary.counters.get("resume/regenerated_tokens", 0) == 0
    every_uid_once(run, [u for x in records for u in x.get("prompt_uids", [])])
    assert sorted(x["step"] for x in records if "prompt_uids" in x) == list(range(1, steps + 1))

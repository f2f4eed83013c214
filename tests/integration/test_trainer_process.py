"""The trainer: FSDP2 ranks on gloo with the built-in tiny model.

In-process tests run one rank (a world-1 gloo group in this process). The slow tests start the real
worker processes through TrainerGroup (2 ranks and 1 rank) and check learning, data-parallel
equivalence, logprobs against plain transformers, weights, checkpoints and shutdown.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from flashrl.config import Config, TrainerConfig, from_dict
from flashrl.core.lr_schedule import scheduled_lr, warmup_lr
from flashrl.launch.processes import spawn_local_trainer
from flashrl.trainer.client import TrainerDied, TrainerGroup
from flashrl.trainer.worker import Trainer
from flashrl.wire.protocol import TrainBatch
from flashrl.wire.trajectory import Trajectory
from flashrl.wire.transport import RemoteError
from flashrl.wire.weights import build_manifest
from tests.helpers import full_weights, trainer_config

PROMPT = [1, 10, 11, 12]
GOOD = [20, 21, 22, 2]  # reward 1
BAD = [30, 31, 2]  # reward 0


def _batch(step: int) -> TrainBatch:
    """5 groups of 3 with different prompts and lengths; in every group GOOD earns 1, BAD 0."""
    samples = []
    for g in range(5):
        prompt = PROMPT + [13 + g] * g
        for j, resp in enumerate((GOOD, BAD, GOOD if g % 2 else BAD)):
            n = len(resp)
            samples.append(Trajectory(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * n,
                                       behav_logp=[-3.0] * n, versions=[max(0, step - j)] * n,
                                       reward=1.0 if resp is GOOD else 0.0, group=g, sample_id=f"{g}-{j}"))
    return TrainBatch(step=step, samples=samples)


# ---------------------------------------------------------------------- one rank in this process
def test_shuffle_deals_other_mini_batches_and_changes_nothing_with_one(world1, model_path: Path, tmp_path: Path) -> None:
    """trainer.shuffle on: with one mini-batch the step is the in-order one (the order does not matter);
    with 2, mini-batch 1 holds other samples, so its loss differs (in order it holds groups 0-2 only)."""
    runs = {}
    for shuffle, minis in ((False, 1), (True, 1), (False, 2), (True, 2)):
        t = Trainer(trainer_config(tmp_path, shuffle=shuffle, mini_batches=minis), str(model_path), torch.device("cpu"))
        r = t.train_step(_batch(3))
        assert r is not None
        runs[shuffle, minis] = r.metrics
    assert runs[True, 1]["loss"] == pytest.approx(runs[False, 1]["loss"], abs=1e-6)
    assert runs[True, 2]["optimizer_steps"] == runs[False, 2]["optimizer_steps"] == 2
    assert runs[True, 2]["samples"] == runs[False, 2]["samples"] == 15
    assert runs[True, 2]["loss"] != pytest.approx(runs[False, 2]["loss"], abs=1e-6)


def test_micro_batches_accumulate_to_the_full_batch_step(world1, model_path: Path, tmp_path: Path) -> None:
    whole = Trainer(trainer_config(tmp_path), str(model_path), torch.device("cpu"))
    split = Trainer(trainer_config(tmp_path, micro_batch=2), str(model_path), torch.device("cpu"))
    r1 = whole.train_step(_batch(0))
    r2 = split.train_step(_batch(0))
    assert r1 is not None and r2 is not None
    # token-mean over the whole batch, not a mean of micro-batch means
    assert r2.metrics["loss"] == pytest.approx(r1.metrics["loss"], abs=1e-6)
    assert r2.metrics["grad_norm"] == pytest.approx(r1.metrics["grad_norm"], rel=1e-5)
    w1, w2 = full_weights(whole), full_weights(split)
    # Adam's first step is lr * g / (|g| + eps): for a coordinate whose gradient is ~eps (1e-8), a
    # summation-order difference of 1e-9 moves it by up to ~lr/10. So: all but a handful of coordinates
    # within 1e-5, and every coordinate within lr. (A wrong weighting of micro-batches is caught by the
    # loss and grad-norm checks above and would also flip the sign, i.e. move by 2 lr, of many coordinates.)
    lr = 1e-3
    for k in w1:
        diff = (w2[k] - w1[k]).abs()
        assert int((diff > 1e-5).sum()) <= max(2, diff.numel() // 10_000), k
        assert float(diff.max()) <= lr, k
    m = r1.metrics
    assert m["samples"] == 15 and m["tokens"] == 52  # 3 groups of 4 + 3 + 3 tokens, 2 of 4 + 3 + 4
    assert m["ratio/mean"] == 1.0  # one mini-batch: on the proximal policy exactly
    assert m["reward/mean"] == pytest.approx(7 / 15)
    assert m["optimizer_steps"] == 1 and "staleness/mean" not in m  # staleness: the controller's metric


def test_mini_batches_ties_and_logprobs(world1, model_path: Path, tmp_path: Path) -> None:
    t = Trainer(trainer_config(tmp_path, mini_batches=5), str(model_path), torch.device("cpu"))
    good0 = sum(t.compute_logprobs(PROMPT, GOOD))
    res = [t.train_step(_batch(s)) for s in range(3)]
    m = res[-1].metrics  # type: ignore[union-attr]
    assert m["optimizer_steps"] == 5
    assert m["ratio/mean"] != 1.0  # later mini-batches move away from the proximal policy
    assert "staleness/mean" not in m  # one staleness metric: the controller's (core/staleness.py)
    assert t.version == 3
    assert sum(t.compute_logprobs(PROMPT, GOOD)) > good0

    # ComputeLogprobs equals a plain transformers forward of the same weights
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    plain.load_state_dict(t.full_state_dict())
    ids = torch.tensor([PROMPT + GOOD])
    with torch.no_grad():
        ref = torch.log_softmax(plain(ids).logits[0, :-1].float(), -1)
    expect = ref[torch.arange(len(PROMPT) - 1, len(PROMPT) + len(GOOD) - 1), torch.tensor(GOOD)]
    assert t.compute_logprobs(PROMPT, GOOD) == pytest.approx(expect.tolist(), abs=1e-5)


def test_recomputed_logprobs_use_the_rollout_temperature(world1, model_path: Path, tmp_path: Path) -> None:
    """Proximal, current and ComputeLogprobs logprobs are scored at rollout.temperature, as the engines
    sample: behaviour logprobs of the same weights then give importance weights of exactly 1."""
    from transformers import AutoModelForCausalLM

    cfg = from_dict({"run": {"output_dir": str(tmp_path), "name": "t"}, "rollout": {"temperature": 0.7},
                     "trainer": {"backend": "gloo", "lr": 1e-3, "threads": 1, "mini_batches": 2},
                     "algorithm": {"loss": "decoupled_ppo"}})
    t = Trainer(cfg, str(model_path), torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    with torch.no_grad():
        logits = plain(torch.tensor([PROMPT + GOOD])).logits[0, len(PROMPT) - 1 : -1].float()
    at = {temp: torch.log_softmax(logits / temp, -1)[torch.arange(len(GOOD)), torch.tensor(GOOD)].tolist()
          for temp in (0.7, 1.0)}
    assert t.compute_logprobs(PROMPT, GOOD) == pytest.approx(at[0.7], abs=1e-5)
    assert t.compute_logprobs(PROMPT, GOOD, temperature=1.0) == pytest.approx(at[1.0], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(at[0.7], at[1.0])) > 0.05

    def batch(behaviour: float) -> TrainBatch:  # behaviour logprobs as an engine at ``behaviour`` returns them
        b = _batch(0)
        for s in b.samples:
            s.behav_logp = t.compute_logprobs(s.prompt_ids, s.response_ids, temperature=behaviour)
        return b

    on_policy, raw = batch(0.7), batch(1.0)
    m = t.train_step(on_policy).metrics  # type: ignore[union-attr]
    # w = pi_prox / pi_behav with both at step start's weights: 1 on every token when temperatures agree
    assert m["iw/mean"] == pytest.approx(1.0, abs=1e-5) and m["iw/max"] == pytest.approx(1.0, abs=1e-5)
    fresh = Trainer(cfg, str(model_path), torch.device("cpu"))
    m_raw = fresh.train_step(raw).metrics  # type: ignore[union-attr]
    assert abs(m_raw["iw/max"] - 1.0) > 0.05  # temperature-1 behaviour logprobs: weights off by the temperature


def test_mismatch_compares_engine_and_trainer_logprobs_of_on_policy_tokens(world1, model_path: Path,
                                                                            tmp_path: Path) -> None:
    """mismatch/kl (k3 of KL(engine || trainer)) and mismatch/max_abs over the tokens sampled by the weights
    the step starts from, against the trainer's first-pass logprobs; stale tokens are left out."""
    import math

    t = Trainer(trainer_config(tmp_path), str(model_path), torch.device("cpu"))
    b = _batch(0)
    for s in b.samples:  # what an engine holding the same weights returns
        s.behav_logp = t.compute_logprobs(s.prompt_ids, s.response_ids)
    b.samples[0].behav_logp = [x + 0.5 for x in b.samples[0].behav_logp]  # one sample's 4 tokens off by 0.5
    m = t.train_step(b).metrics  # type: ignore[union-attr]
    assert m["mismatch/tokens"] == 52
    assert m["mismatch/max_abs"] == pytest.approx(0.5, abs=1e-5)
    assert m["mismatch/kl"] == pytest.approx(4 * (math.exp(-0.5) - 1 + 0.5) / 52, rel=1e-4)

    same = Trainer(trainer_config(tmp_path, mini_batches=3), str(model_path), torch.device("cpu"))
    b = _batch(0)
    for s in b.samples:
        s.behav_logp = same.compute_logprobs(s.prompt_ids, s.response_ids)
    m = same.train_step(b).metrics  # type: ignore[union-attr]
    assert m["mismatch/kl"] < 1e-10 and m["mismatch/max_abs"] < 1e-5  # later mini-batches: still the first pass

    stale = Trainer(trainer_config(tmp_path), str(model_path), torch.device("cpu"))
    m = stale.train_step(_batch(2)).metrics  # type: ignore[union-attr]
    assert m["mismatch/tokens"] == 5 * len(GOOD)  # only sample 0 of each group was sampled by version 2
    b = _batch(2)
    for s in b.samples:
        s.versions = [0] * len(s.versions)
    assert not any(k.startswith("mismatch/") for k in stale.train_step(b).metrics)  # type: ignore[union-attr]


def test_warmup_ramps_lr_by_step(world1, model_path: Path, tmp_path: Path) -> None:
    assert warmup_lr(2e-4, 0, 0) == 2e-4  # off
    assert [warmup_lr(2e-4, 4, s) for s in range(6)] == pytest.approx([5e-5, 1e-4, 1.5e-4, 2e-4, 2e-4, 2e-4])
    t = Trainer(trainer_config(tmp_path, lr=1e-3, warmup_steps=4, lr_decay="none"), str(model_path), torch.device("cpu"))
    # the lr follows the batch's step (not a call count), so a resumed run at step 1 continues the ramp
    lrs = [t.train_step(_batch(s)).metrics["lr"] for s in (1, 2, 7)]  # type: ignore[union-attr]
    assert lrs == pytest.approx([5e-4, 7.5e-4, 1e-3])
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_lr_decay_follows_the_step_from_warmup_to_the_last_step(world1, model_path: Path, tmp_path: Path) -> None:
    def tc(**kw: object) -> TrainerConfig:
        return from_dict({"trainer": {"lr": 1e-3, "warmup_steps": 4, "lr_decay": "none", "min_lr_ratio": 0.0, **kw}}).trainer

    assert [scheduled_lr(tc(), 10, s) for s in (0, 3, 9, 20)] == pytest.approx([2.5e-4, 1e-3, 1e-3, 1e-3])  # none
    # linear over steps 3..9 (the warm-up's last step at full lr, the run's last at lr * min_lr_ratio)
    lin = [scheduled_lr(tc(lr_decay="linear", min_lr_ratio=0.1), 10, s) for s in range(12)]
    assert lin[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lin[3:10] == pytest.approx([1e-3 * (0.1 + 0.9 * (1 - k / 6)) for k in range(7)])
    assert lin[10:] == pytest.approx([1e-4, 1e-4])  # past the last step (a run given more steps): the floor
    cos = [scheduled_lr(tc(lr_decay="cosine"), 10, s) for s in range(3, 10)]
    assert cos[0] == pytest.approx(1e-3) and cos[3] == pytest.approx(5e-4) and cos[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a > b for a, b in zip(cos, cos[1:]))
    assert scheduled_lr(tc(warmup_steps=0, lr_decay="linear"), 5, 0) == pytest.approx(1e-3)  # no warm-up: from step 0
    # the trainer sets it from the batch's step and run.steps, so a resumed run continues the decay
    t = Trainer(trainer_config(tmp_path, lr=1e-3, warmup_steps=0, lr_decay="linear", min_lr_ratio=0.0), str(model_path),
                torch.device("cpu"))
    t.cfg.run.steps = 5
    lrs = [t.train_step(_batch(s)).metrics["lr"] for s in (4, 0, 2)]  # type: ignore[union-attr]
    assert lrs == pytest.approx([0.0, 1e-3, 5e-4])


def test_filter_ties_drops_tied_groups(world1, model_path: Path, tmp_path: Path) -> None:
    t = Trainer(trainer_config(tmp_path, algorithm={"filter_ties": True}), str(model_path), torch.device("cpu"))
    b = _batch(0)
    for s in b.samples:
        if s.group == 1:
            s.reward = 0.5  # group 1 ties
    m = t.train_step(b).metrics  # type: ignore[union-attr]
    assert m["groups"] == 5 and m["groups/tied"] == 1 and m["groups/filtered"] == 1
    assert m["tokens"] == 52 - (4 + 3 + 4)  # group 1's 11 tokens left out of the token mean


def test_checkpoint_is_atomic_refuses_overwrite_and_restores(world1, model_path: Path, tmp_path: Path) -> None:
    t = Trainer(trainer_config(tmp_path), str(model_path), torch.device("cpu"))
    t.train_step(_batch(0))
    path = tmp_path / "ckpt" / "step1"
    (tmp_path / "ckpt" / "step1.tmp").mkdir(parents=True)  # a crashed earlier save
    (tmp_path / "ckpt" / "step1.tmp" / "junk").write_text("x")
    t.save_checkpoint(str(path))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step1"]
    assert {".metadata", "trainer.json"} <= set(os.listdir(path)) and "junk" not in os.listdir(path)
    with pytest.raises(FileExistsError, match="already exists"):
        t.save_checkpoint(str(path))
    fresh = Trainer(trainer_config(tmp_path), str(model_path), torch.device("cpu"))
    assert fresh.compute_logprobs(PROMPT, GOOD) != t.compute_logprobs(PROMPT, GOOD)
    fresh.load_checkpoint(str(path))
    assert fresh.version == 1
    assert fresh.compute_logprobs(PROMPT, GOOD) == t.compute_logprobs(PROMPT, GOOD)
    # the optimizer state came back too: the next step is the same step
    t.train_step(_batch(1))
    fresh.train_step(_batch(1))
    assert fresh.compute_logprobs(PROMPT, BAD) == pytest.approx(t.compute_logprobs(PROMPT, BAD), abs=1e-6)


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_background_checkpoint_is_the_state_at_the_save_and_appears_only_when_sealed(world1, model_path: Path,
                                                                                   tmp_path: Path, writer: str) -> None:
    """trainer.checkpoint_async: the save stages the state and returns; a step trained meanwhile does not leak
    into it; ``path`` appears only after finish_checkpoint; loading it restores weights, optimizer and version.
    Written by a writer process (the CPU default for large models) or a thread of the trainer (trainer.checkpoint_writer)."""
    t = Trainer(trainer_config(tmp_path, checkpoint_writer=writer), str(model_path), torch.device("cpu"))
    assert t.checkpoint_writer == writer
    t.train_step(_batch(0))
    at_save = t.compute_logprobs(PROMPT, GOOD)
    path = tmp_path / "ckpt" / "step1"
    assert t.save_checkpoint(str(path), background=True) == 0.0
    t.train_step(_batch(1))  # beside the write: changes weights and AdamW state in place
    assert t.compute_logprobs(PROMPT, GOOD) != at_save
    assert not path.exists()  # not before it is sealed, however far the write has got
    write_s = t.finish_checkpoint(str(path), 60.0)
    assert write_s > 0 and {".metadata", "trainer.json"} <= set(os.listdir(path))
    assert not (tmp_path / "ckpt" / "step1.tmp").exists()
    fresh = Trainer(trainer_config(tmp_path), str(model_path), torch.device("cpu"))
    fresh.load_checkpoint(str(path))
    assert fresh.version == 1
    assert fresh.compute_logprobs(PROMPT, GOOD) == at_save  # exactly the staged state, not step 1's
    # the optimizer state came back too: step 1 again gives what the original's step 1 gave
    fresh.train_step(_batch(1))
    assert fresh.compute_logprobs(PROMPT, BAD) == pytest.approx(t.compute_logprobs(PROMPT, BAD), abs=1e-6)
    # a write never sealed (its finish never came: the controller died) is not a checkpoint
    lost = tmp_path / "ckpt" / "step2"
    t.save_checkpoint(str(lost), background=True)
    t.close_checkpoints(60.0)  # shutdown: waits for the write, seals nothing
    assert not lost.exists() and (tmp_path / "ckpt" / "step2.tmp").exists()
    with pytest.raises(RuntimeError, match="no checkpoint write of"):
        t.finish_checkpoint(str(lost), 1.0)
    # a second save while one is in flight waits for it (and reports the wait)
    t.save_checkpoint(str(tmp_path / "ckpt" / "a"), background=True)
    assert t.save_checkpoint(str(tmp_path / "ckpt" / "b"), background=True) >= 0.0
    t.finish_checkpoint(str(tmp_path / "ckpt" / "b"), 60.0)
    assert (tmp_path / "ckpt" / "b").is_dir() and not (tmp_path / "ckpt" / "a").exists()
    t.close_checkpoints(60.0)


# ---------------------------------------------------------------------- real rank processes
def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (/proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
async def _group(cfg: Config, model_path: Path, tmp: Path, name: str) -> TrainerGroup:
    run_dir = tmp / name
    run_dir.mkdir()
    return await spawn_local_trainer(cfg, model_path, run_dir)


def _load_dcp(path: Path, model_path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).state_dict()
    state = {"model": {k: torch.empty_like(v) for k, v in sd.items()}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["model"]


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_two_ranks_learn_match_one_rank_and_shut_down(model_path: Path, tmp_path: Path) -> None:
    steps = 3
    groups = {}
    results = {}
    for ranks in (2, 1):
        cfg = trainer_config(tmp_path, ranks=ranks, mini_batches=5, micro_batch=1)
        g = await _group(cfg, model_path, tmp_path, f"r{ranks}")
        groups[ranks] = g
        try:
            await g.wait_ready(120)
            before = (sum(await g.compute_logprobs(PROMPT, GOOD)), sum(await g.compute_logprobs(PROMPT, BAD)))
            metrics = [(await g.train_step(_batch(s))).metrics for s in range(steps)]
            after = (sum(await g.compute_logprobs(PROMPT, GOOD)), sum(await g.compute_logprobs(PROMPT, BAD)))
            assert await g.ping() == steps
            ckpt = tmp_path / f"ckpt{ranks}"
            await g.save_checkpoint(ckpt)
            with pytest.raises(RemoteError, match="already exists"):
                await g.save_checkpoint(ckpt)
            manifest = await g.prepare_weights(steps)
            lp = await g.compute_logprobs(PROMPT, GOOD)
            results[ranks] = (before, after, metrics, ckpt, manifest, lp)
            if ranks == 2:
                # SIGTERM while idle: every rank exits cleanly (code 0), no orphans
                for p in g.procs:
                    os.killpg(p.pid, signal.SIGTERM)
                codes = [p.wait(timeout=30) for p in g.procs]
                assert codes == [0, 0], [(p.read_text()[-2000:]) for p in g.logs]
            else:
                await g.close()
                assert [p.returncode for p in g.procs] == [0]
        finally:
            await g.close()

    (b2, a2, m2, ck2, man2, lp2) = results[2]
    (b1, a1, m1, ck1, man1, lp1) = results[1]
    # reward favours GOOD: its probability rises, BAD's falls
    assert a2[0] > b2[0] + 0.05 and a2[1] < b2[1]
    assert b1 == pytest.approx(b2, abs=1e-5)  # same initial weights on both groups
    # data-parallel split with global token-mean weighting == one rank on the whole batch
    for x, y in zip(m2, m1):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
        assert x["reward/mean"] == y["reward/mean"] and x["tokens"] == y["tokens"] == 52
    w2, w1 = _load_dcp(ck2, model_path), _load_dcp(ck1, model_path)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=2e-5, rtol=0)
    # ComputeLogprobs == a plain transformers forward of the checkpointed weights
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    plain.load_state_dict(w2)
    with torch.no_grad():
        ref = torch.log_softmax(plain(torch.tensor([PROMPT + GOOD])).logits[0, :-1], -1)
    expect = ref[torch.arange(len(PROMPT) - 1, len(PROMPT) + len(GOOD) - 1), torch.tensor(GOOD)].tolist()
    assert lp2 == pytest.approx(expect, abs=1e-5)
    # PrepareWeights gathered exactly the checkpointed full weights: identical bucket checksums
    local, _ = build_manifest(w2, steps, groups[2].cfg.weight_sync.bucket_mb, tie_word_embeddings=True)
    assert [b.checksum for b in man2.buckets] == [b.checksum for b in local.buckets]
    assert man2.version == steps and man1.buckets[0].tensors == man2.buckets[0].tensors
    # checkpoints load across layouts: one rank's (a plain module) into two FSDP ranks, and back
    for ranks, ckpt, expect_lp in ((2, ck1, lp1), (1, ck2, lp2)):
        cfg = trainer_config(tmp_path, ranks=ranks, mini_batches=5, micro_batch=1)
        run_dir = tmp_path / f"resumed{ranks}"
        run_dir.mkdir()
        g = await spawn_local_trainer(cfg, model_path, run_dir, resume=ckpt)
        try:
            await g.wait_ready(120)
            assert await g.ping() == steps
            assert await g.compute_logprobs(PROMPT, GOOD) == pytest.approx(expect_lp, abs=1e-5)
        finally:
            await g.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_two_ranks_write_a_background_checkpoint_that_one_rank_resumes_exactly(model_path: Path,
                                                                                      tmp_path: Path) -> None:
    """FSDP2 at world 2 (sharded DTensor state, staged by each rank, written over the checkpoint gloo group,
    sealed by rank 0 once every rank's write is in): a step trains beside the write, the checkpoint holds
    the state at the save, and one rank resumes it with the same weights and version."""
    from flashrl.checkpoint import TRAINER_DIR, CheckpointWriter, ControllerState

    cfg = trainer_config(tmp_path, ranks=2, mini_batches=5, micro_batch=1)
    root = tmp_path / "run2" / "checkpoints"
    g = await _group(cfg, model_path, tmp_path, "run2")
    try:
        await g.wait_ready(120)
        w = CheckpointWriter(root, g, "", keep=3, background=True, timeout_s=120.0)
        await g.train_step(_batch(0))
        at_save = await g.compute_logprobs(PROMPT, GOOD)
        await w.save(ControllerState(step=1, version=1, elapsed_s=1.0), wait=False)
        await g.train_step(_batch(1))  # beside the write
        assert await g.compute_logprobs(PROMPT, GOOD) != pytest.approx(at_save, abs=1e-6)
        await w.close()
        assert w.saved == 1 and w.failed == 0 and (root / "step-1" / TRAINER_DIR / "trainer.json").is_file()
    finally:
        await g.close()
    one = trainer_config(tmp_path, ranks=1, mini_batches=5, micro_batch=1)
    g = await spawn_local_trainer(one, model_path, tmp_path / "run2", resume=root / "step-1" / TRAINER_DIR)
    try:
        await g.wait_ready(120)
        assert await g.ping() == 1
        assert await g.compute_logprobs(PROMPT, GOOD) == pytest.approx(at_save, abs=1e-5)
    finally:
        await g.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_trainer_killed_during_a_background_checkpoint_write_resumes_from_the_previous_one(
        model_path: Path, tmp_path: Path) -> None:
    """The real trainer process, the run's CheckpointWriter in background mode: step-1 completes; step-2's
    write is in flight (staged, not sealed) when the trainer is SIGKILLed. step-2 never appears, latest
    stays step-1, resume picks step-1, and a trainer started from it has step 1's weights and version."""
    import asyncio

    from flashrl.checkpoint import TRAINER_DIR, CheckpointWriter, ControllerState, read_latest
    from flashrl.resuming import find_checkpoint

    cfg = trainer_config(tmp_path, ranks=1, checkpoint_writer="process")
    root = tmp_path / "run" / "checkpoints"
    g = await _group(cfg, model_path, tmp_path, "run")
    seen: list[tuple[Path | None, object]] = []
    try:
        await g.wait_ready(120)
        w = CheckpointWriter(root, g, "", keep=3, background=True, timeout_s=120.0)
        assert w.background
        await g.train_step(_batch(0))
        lp1 = await g.compute_logprobs(PROMPT, GOOD)
        assert await w.save(ControllerState(step=1, version=1, elapsed_s=1.0), wait=False) is None
        await g.train_step(_batch(1))  # trains while step-1 is written
        await w.wait()
        assert read_latest(root) == root / "step-1" and w.saved == 1
        await w.save(ControllerState(step=2, version=2, elapsed_s=2.0), wait=False,
                     on_done=lambda p, e: seen.append((p, e)))
        # the trainer's children: DCP's writer process and multiprocessing's resource tracker, in its process group
        writers = _children(g.procs[0].pid)
        assert writers, "no writer process under the trainer: the background write did not use one"
        os.kill(g.procs[0].pid, signal.SIGKILL)  # the write is staged and in flight; nothing has sealed it
        await asyncio.wait_for(w.wait(), 60)
    finally:
        await g.close()
    for _ in range(100):  # the trainer's writer goes with it (its process group is ended): no process outlives it
        if not any(_alive(p) for p in writers):
            break
        await asyncio.sleep(0.1)
    assert not [p for p in writers if _alive(p)], f"the trainer's children outlived it: {writers}"
    assert len(seen) == 1 and seen[0][0] is None and "not written" in str(seen[0][1])
    assert not (root / "step-2").exists() and read_latest(root) == root / "step-1" and w.failed == 1
    r = find_checkpoint(tmp_path / "run")
    assert r.step == 1 and r.skipped == []
    g = await spawn_local_trainer(cfg, model_path, tmp_path / "run", resume=root / "step-1" / TRAINER_DIR)
    try:
        await g.wait_ready(120)
        assert await g.ping() == 1
        assert await g.compute_logprobs(PROMPT, GOOD) == pytest.approx(lp1, abs=1e-6)
    finally:
        await g.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_rank_that_dies_fails_wait_ready_with_its_log(tmp_path: Path) -> None:
    cfg = trainer_config(tmp_path, ranks=1)
    g = await _group(cfg, tmp_path / "no-such-model", tmp_path, "bad")
    try:
        with pytest.raises(TrainerDied, match=r"rank 0 exited with code 1[\s\S]*no-such-model"):
            await g.wait_ready(100)
    finally:
        await g.close()
    assert g.procs[0].returncode == 1


def test_fsdp_clips_every_parameter_after_a_proximal_pass(world1, model_path: Path, tmp_path: Path) -> None:
    """Regression: with several mini-batches the no-grad proximal forward leaves FSDP2's root group
    unsharded, and model.parameters() then named the unsharded tensors: the root group (embeddings,
    final norm) was missing from the gradient norm and from the clip. FSDP must match a plain module."""
    from transformers import AutoModelForCausalLM

    from flashrl.trainer.step import PolicyTrainer

    cfg = trainer_config(tmp_path, mini_batches=5, micro_batch=1)
    fsdp = Trainer(cfg, str(model_path), torch.device("cpu"))
    plain_model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    plain_model.train(False)
    plain = PolicyTrainer(cfg, plain_model, torch.device("cpu"))
    r1, r2 = fsdp.train_step(_batch(0)), plain.train_step(_batch(0))
    assert r1 is not None and r2 is not None
    assert r1.metrics["grad_norm"] == pytest.approx(r2.metrics["grad_norm"], rel=1e-5)
    assert r1.metrics["loss"] == pytest.approx(r2.metrics["loss"], abs=1e-6)


class _HeldSender:
    """Stands in for rank 0's WeightSender (tests only): each send blocks until released, like an engine
    slow to receive, and records the checksums of the buckets it was given."""

    def __init__(self) -> None:
        import threading

        self.started = threading.Event()
        self.release = threading.Event()
        self.sent: list[list[str]] = []
        self.stuck = 0  # broadcasts left to dropped peers (WeightSender.stuck): none here

    def send(self, buckets: list[torch.Tensor], peers: list[str] | None = None) -> tuple[float, dict[str, str]]:
        from flashrl.wire.weights import bucket_checksum

        self.started.set()
        assert self.release.wait(60), "never released"
        self.sent.append([bucket_checksum(b) for b in buckets])
        return 0.0, {}


@pytest.mark.timeout(180)
async def test_rank0_trains_while_a_send_runs_and_refuses_a_prepare_meanwhile(world1, model_path: Path,
                                                                                tmp_path: Path) -> None:
    """leader_loop: SendWeights runs on the weight sender's thread, so a TrainStep completes while it sends; the
    buckets being sent are the prepared version's, unchanged by that step; a PrepareWeights while the
    send runs is a loud error (before any gather), and works again once the send is done."""
    import asyncio

    from flashrl.trainer.worker import Fanout, leader_loop
    from flashrl.wire import protocol
    from flashrl.wire.protocol import (
        Ok,
        PrepareWeights,
        SendWeights,
        Shutdown,
        TrainResult,
        TrainStep,
        WeightManifest,
    )
    from flashrl.wire.transport import RpcClient, free_port

    trainer = Trainer(trainer_config(tmp_path), str(model_path), torch.device("cpu"))
    held = _HeldSender()
    trainer.weights.sender = held
    address = f"tcp://127.0.0.1:{free_port()}"
    server = asyncio.create_task(leader_loop(trainer, Fanout(torch.device("cpu"), [False]), address))
    client = RpcClient(address, protocol.TRAINER_REPLIES, name="trainer")
    client.start()
    loop = asyncio.get_running_loop()
    try:
        v1 = await client.request(PrepareWeights(version=1), timeout=60)
        assert isinstance(v1, WeightManifest)
        send = asyncio.ensure_future(client.request(SendWeights(version=1), timeout=120))
        assert await loop.run_in_executor(None, held.started.wait, 30)
        result = await client.request(TrainStep(batch=_batch(0)), timeout=60)  # beside the send
        assert isinstance(result, TrainResult) and not send.done()
        with pytest.raises(RemoteError, match=r"PrepareWeights\(2\) while SendWeights\(1\) is still sending"):
            await client.request(PrepareWeights(version=2), timeout=60)
        held.release.set()
        reply = await send
        assert isinstance(reply, Ok) and "sent version 1" in reply.info
        assert held.sent == [[b.checksum for b in v1.buckets]]  # what v1's manifest promised, not the trained weights
        v2 = await client.request(PrepareWeights(version=2), timeout=60)
        assert isinstance(v2, WeightManifest) and [b.checksum for b in v2.buckets] != [b.checksum for b in v1.buckets]
        # a catch-up resend of the published version does not block a prepare: only a publication does
        held.release.set()
        again = await client.request(SendWeights(version=1), timeout=60)
        assert isinstance(again, Ok) and len(held.sent) == 2
        await client.request(Shutdown(), timeout=30)
        await asyncio.wait_for(server, 30)
    finally:
        held.release.set()
        await client.close()
        if not server.done():
            server.cancel()

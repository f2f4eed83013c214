"""The trajectory record (flashrl/wire/trajectory.py): one struct from the engine's reply to the trainer's batch.

A per-token field is one field of the record plus the code that fills and reads it: ``top_logprobs``
(engine.top_logprobs = k) is filled by the engines, kept by the rollouts, carried by TrainBatch and padded by
the trainer's batch builder; the tests here follow it the whole way through the controller on fakes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from flashrl.config import Config
from flashrl.controller.controller import Controller
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import FakeEngine, FakeSuite, FakeTokenizer, FakeTrainer
from flashrl.trainer.batch import pad_batch
from flashrl.wire.protocol import Codec, TrainBatch, TrainerRequest, TrainStep, encode
from flashrl.wire.trajectory import Trajectory

TOK = FakeTokenizer()


def _trained(top_logprobs: int, turns: int = 1) -> list[TrainBatch]:
    cfg = msgspec.convert({"run": {"steps": 2, "seed": 3, "eval_every": 0},
                           "rollout": {"group_size": 2, "batch_prompts": 2, "max_new_tokens": 6, "max_turns": turns},
                           "engine": {"top_logprobs": top_logprobs}}, Config)
    trainer = FakeTrainer()
    c = Controller(cfg, TOK, FakeSuite(n_train=6, turns=turns), [FakeEngine("e0")], trainer)

    async def main() -> Any:
        return await c.run()

    assert run_virtual(main).result.steps == 2
    return trainer.batches


def _through_the_wire(batch: TrainBatch) -> TrainBatch:
    msg = Codec(TrainerRequest, "trainer").decode(encode(TrainStep(batch=batch)))
    assert isinstance(msg, TrainStep)
    return msg.batch


def test_top_logprobs_reach_the_trainers_batch() -> None:
    batches = _trained(top_logprobs=3, turns=2)
    samples = [t for b in batches for t in _through_the_wire(b).samples]
    assert samples and any(0 in t.loss_mask for t in samples)  # observation tokens too (multi-turn)
    for t in samples:
        assert len(t.top_logprobs) == len(t.response_ids)
        for m, top, tok, lp in zip(t.loss_mask, t.top_logprobs, t.response_ids, t.behav_logp):
            # the fake engine ranks the sampled token first; observation tokens carry none
            assert (len(top), top[0] if top else None) == ((3, (tok, lp)) if m else (0, None))
    pb = pad_batch(samples, pad_id=0)
    assert pb.top_ids.shape == (*pb.targets.shape, 3) and pb.top_logp.shape == pb.top_ids.shape
    gen = pb.loss_mask > 0
    # aligned like behav_logp: rank 1 at each generated token is that token (targets) with its logprob
    assert torch.equal(pb.top_ids[..., 0][gen], pb.targets[gen])
    assert torch.allclose(pb.top_logp[..., 0][gen], pb.behav_logp[gen])
    assert torch.equal(pb.top_ids[..., 1][gen], pb.targets[gen] + 1)
    assert (pb.top_ids[~gen] == -1).all() and (pb.top_logp[~gen] == 0).all()
    sub = pb.select([1, 0])  # the per-rank / micro-batch cut keeps them aligned
    assert torch.equal(sub.top_ids[0, : sub.targets.shape[1]], pb.top_ids[1, : sub.targets.shape[1]])


def test_top_logprobs_are_off_by_default() -> None:
    assert Config().engine.top_logprobs == 0
    samples = [t for b in _trained(top_logprobs=0) for t in b.samples]
    assert samples and all(t.top_logprobs == [] for t in samples)
    pb = pad_batch(samples, pad_id=0)
    assert pb.top_ids.shape == (*pb.targets.shape, 0)
    # and off, the record on the wire carries nothing for it (omit_defaults)
    assert b"top_logprobs" not in msgspec.msgpack.encode(samples[0])


def test_the_record_is_the_trainers_sample() -> None:
    t = Trajectory(sample_id="1-0", group=1, prompt_ids=[5], response_ids=[6, 7], loss_mask=[1, 0],
                   behav_logp=[-0.5, 0.0], versions=[2, -1], reward=1.0, top_logprobs=[[(6, -0.5)], []])
    (back,) = _through_the_wire(TrainBatch(step=0, samples=[t])).samples
    assert back == t


def test_the_vllm_engine_reads_the_k_most_likely_by_rank() -> None:
    """engine/server.py asks vLLM for logprobs=k; each position's dict (token id -> Logprob) holds the k most
    likely and the sampled token at its own rank (k + 1 entries when it is not among them)."""
    from types import SimpleNamespace as L

    from flashrl.engine.server import top_k_of

    pos = [{9: L(logprob=-4.0, rank=7), 3: L(logprob=-0.2, rank=1), 5: L(logprob=-1.9, rank=2)},
           {4: L(logprob=-1.0, rank=2), 8: L(logprob=-0.5, rank=1)}]
    assert top_k_of(pos, 2) == [[(3, -0.2), (5, -1.9)], [(8, -0.5), (4, -1.0)]]
    assert top_k_of(pos, 0) == []

"""Mixture-of-Experts: builtin:moe's folder, routes (pack, check, rollouts, batches, checkpoints) and routing replay."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from flashrl.config import Config
from flashrl.controller.context import RolloutContext, RolloutSpec
from flashrl.controller.rollout import run_sample
from flashrl.controller.scheduler import Router
from flashrl.moe.replay import RouteReplay, RouteReplayError, combine_weights
from flashrl.moe.routes import (
    RoutesError,
    RouteShape,
    check_routes,
    pack_routes,
    route_rows,
    stand_in_routes,
    unpack_routes,
)
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import FakeEngine, FakeSuite, FakeTokenizer
from flashrl.trainer.batch import pad_batch
from flashrl.wire.trajectory import Trajectory, snapshot

SHAPE = RouteShape(2, 8, 2)


def tiny_moe(seed: int = 0, experts: int = 8) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=16, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[],
                         max_position_embeddings=64, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg).float().eval()


# --------------------------------------------------------------------------- routes
def test_pack_unpack_round_trip_sorted_per_layer() -> None:
    ids = np.array([[[5, 1], [7, 0]], [[2, 3], [6, 4]]])
    data = pack_routes(ids, SHAPE)
    assert len(data) == 2 * SHAPE.row_bytes == 8
    assert unpack_routes(data, SHAPE).tolist() == [[[1, 5], [0, 7]], [[2, 3], [4, 6]]]
    wide = RouteShape(1, 300, 2)  # past 256 experts: two bytes per id
    assert unpack_routes(pack_routes(np.array([[[299, 3]]]), wide), wide).tolist() == [[[3, 299]]]


@pytest.mark.parametrize("data,what", [
    (bytes(3 * 4), "is 0"),  # all-zero routes: an engine that captured nothing
    (bytes(2 * 4), "for 3 tokens"),  # rows missing
    (pack_routes(np.array([[[1, 9], [0, 2]]] * 3), SHAPE), "outside"),  # expert 9 of 8
    (pack_routes(np.array([[[1, 1], [0, 2]]] * 3), SHAPE), "twice"),
])
def test_malformed_routes_name_the_engine(data: bytes, what: str) -> None:
    with pytest.raises(RoutesError, match=f"engine engine3: .*{what}"):
        check_routes(data, 3, SHAPE, "engine3")


def test_stand_in_routes_are_well_formed() -> None:
    data = stand_in_routes(SHAPE, seed=1)(5)
    check_routes(data, 5, SHAPE, "fake")
    assert len(route_rows(data, 5, SHAPE, "fake")) == 5


# --------------------------------------------------------------------------- rollouts on a fake engine
def _one_sample(routes: Any) -> Trajectory:
    cfg = msgspec.convert({"rollout": {"max_new_tokens": 3}, "model": {"max_model_len": 32}}, Config)
    tok = FakeTokenizer()
    eng = FakeEngine("engine7", lambda req, v: (tok.encode("42"), 1.0), routes=routes)
    ctx = RolloutContext(cfg=cfg, tokenizer=tok, suite=FakeSuite(), engines=[eng], router=Router(1, 8),
                         version=lambda: 0, routes=SHAPE)
    task = ctx.suite.train_tasks()[0]
    spec = RolloutSpec(task=task, group=0, index=0, temperature=1.0, seed_key=(0, 0), sample_id="0-0")
    ctx.router.take(0)
    return run_virtual(lambda: run_sample(ctx, spec, 0)).result


def test_rollout_keeps_one_route_row_per_token() -> None:
    t = _one_sample(stand_in_routes(SHAPE))
    assert t.status == "ok" and len(t.routes) == len(t.response_ids) == 2
    assert all(len(r) == SHAPE.row_bytes for r in t.routes)
    assert snapshot(t).routes == t.routes  # a checkpoint keeps them (resume replays the saved routes)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(snapshot(t)), type=Trajectory).routes == t.routes


@pytest.mark.parametrize("bad", [lambda n: bytes(n * 4), lambda n: b"", lambda n: bytes(range(8, 8 + n * 4))])
def test_rollout_refuses_malformed_routes_loudly(bad: Any) -> None:
    with pytest.raises(RoutesError, match="engine engine7"):
        _one_sample(bad)


def test_resumed_rollout_continues_with_the_saved_routes() -> None:
    """A saved prefix continues with its own routes when this run captures routes of the same shape; with none
    (capture off now) it continues without any; saved without one route per token (a run that captured none),
    it is generated again (counted) rather than trained with tokens whose routes are missing; a malformed saved
    route is a RoutesError naming the checkpoint's rollout."""
    from collections import Counter

    from flashrl.controller.rollout import _continue

    def go(routes: list[bytes], shape: RouteShape | None) -> tuple[Trajectory, Counter[str]]:
        saved = Trajectory(sample_id="4-1", group=0, prompt_ids=[1, 2], response_ids=[3], loss_mask=[1],
                           behav_logp=[-0.5], versions=[0], routes=routes)
        traj = Trajectory(group=0, prompt_ids=[1, 2])

        class Ctx:
            counters: Counter[str] = Counter()

        ctx = Ctx()
        ctx.routes = shape  # type: ignore[attr-defined]
        _continue(ctx, saved, traj)  # type: ignore[arg-type]
        return traj, ctx.counters

    row = b"\x01\x02\x03\x04"
    traj, c = go([row], SHAPE)
    assert traj.routes == [row] and traj.response_ids == [3] and not c
    traj, c = go([row], None)
    assert traj.routes == [] and traj.response_ids == [3]
    for missing in ([], [b"\x01\x02"]):
        traj, c = go(missing, SHAPE)
        assert traj.response_ids == [] and traj.routes == [] and c["resume/regenerated_tokens"] == 1
    with pytest.raises(RoutesError, match="checkpoint's rollout 4-1.*is 0"):
        go([bytes(4)], SHAPE)


# --------------------------------------------------------------------------- batches
def test_pad_batch_aligns_routes_with_the_logits_that_sampled_them() -> None:
    r = [pack_routes(np.array([[[k, 7], [0, k + 1]]]), SHAPE) for k in range(3)]
    s = Trajectory(group=0, prompt_ids=[5, 6], response_ids=[1, 2, 3], loss_mask=[1, 0, 1], behav_logp=[0.0] * 3,
                   versions=[0, -1, 0], routes=[r[0], b"", r[2]])
    b = pad_batch([s, Trajectory(group=1, prompt_ids=[5], response_ids=[1], loss_mask=[1], behav_logp=[0.0],
                                 versions=[0])], pad_id=0)
    ids = RouteReplay(tiny_moe(), "r3").decode(b.routes)
    assert b.routes.shape == (2, 4, 4)
    assert ids[0, 1].tolist() == [[0, 7], [0, 1]]  # response token 0 was sampled from position P - 1 = 1
    assert (ids[0, 2] == -1).all() and ids[0, 3].tolist() == [[2, 7], [0, 3]]
    assert (ids[1] == -1).all()  # no routes: the router routes itself
    assert (b.select([0]).routes == b.routes[:1, :4]).all()


# --------------------------------------------------------------------------- replay
def _routes(b: int, length: int, seed: int) -> torch.Tensor:
    """PaddedBatch.routes [b, length - 1, 4]: random distinct sorted experts on every position."""
    rng = np.random.default_rng(seed)
    ids = np.sort(np.stack([[[rng.choice(8, 2, replace=False) for _ in range(2)] for _ in range(length - 1)]
                            for _ in range(b)]), axis=-1)
    return torch.tensor(ids.reshape(b, length - 1, 4), dtype=torch.int16)


class _RefRouter(torch.nn.Module):
    """The reference: softmax over every router logit, gathered at the given experts, renormalized."""

    def __init__(self, weight: torch.nn.Parameter, forced: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.forced = weight, forced

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = hidden.reshape(-1, hidden.shape[-1]) @ self.weight.T
        p = torch.exp(logits - logits.logsumexp(-1, keepdim=True))
        picked = torch.stack([p[torch.arange(len(p)), self.forced[:, j]] for j in range(self.forced.shape[1])], -1)
        return logits, picked / picked.sum(-1, keepdim=True), self.forced


def test_r3_forces_routes_and_router_gradients_equal_the_reference() -> None:
    model = tiny_moe()
    ref = copy.deepcopy(model)
    replay = RouteReplay(model, "r3")
    ids = torch.randint(2, 32, (3, 6))
    routes = _routes(3, 6, seed=0)
    forced = torch.nn.functional.pad(replay.decode(routes), (0, 0, 0, 0, 0, 1), value=-1)  # [3, 6, 2, 2]
    used: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda m, a: used.append(a[1]))
    with replay.forcing(routes, 6):
        model(input_ids=ids).logits.sum().backward()
    for pos, got in enumerate(used):
        want = forced[:, :5, pos].reshape(3, 5, 2)
        assert torch.equal(got.view(3, 6, 2)[:, :5].sort(-1).values, want)  # replayed on every routed position
    # the reference model: the same weights, its routers replaced by the reference computation
    for pos, layer in enumerate(ref.model.layers):
        layer.mlp.gate = _RefRouter(layer.mlp.gate.weight, forced[:, :, pos].reshape(-1, 2).clone())
    # the last position has no route: route it as the model does (its own top-k) in the reference too
    with torch.no_grad():
        captured: list[torch.Tensor] = []
        hooks = [lay.mlp.gate.register_forward_hook(lambda m, a, o: captured.append(o[2])) for lay in model.model.layers]
        model(input_ids=ids)
        for h in hooks:
            h.remove()
    for pos, layer in enumerate(ref.model.layers):
        f = layer.mlp.gate.forced.view(3, 6, 2)
        f[:, 5] = captured[pos].view(3, 6, 2)[:, 5]
    ref(input_ids=ids).logits.sum().backward()
    for a, b in zip(model.model.layers, ref.model.layers):
        g, r = a.mlp.gate.weight.grad, b.mlp.gate.weight.grad
        assert g is not None and r is not None and g.abs().sum() > 0
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_combine_weights_renormalize_the_full_softmax() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w = combine_weights(logits, torch.tensor([[0, 2]]), normalize=True)
    p = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(w, torch.stack([p[0], p[2]]).unsqueeze(0) / (p[0] + p[2]))


def _batch(routes: list[list[bytes]] | None = None, versions: int = 0) -> Any:
    s = [Trajectory(group=i, prompt_ids=[3, 4], response_ids=[5, 6, 7], loss_mask=[1, 1, 1], behav_logp=[0.0] * 3,
                    versions=[versions] * 3, routes=routes[i] if routes else []) for i in range(2)]
    return pad_batch(s, pad_id=0)


def _forward(model: Any, replay: RouteReplay) -> Any:
    def forward(b: Any) -> Any:  # what PolicyTrainer.forward_logprobs does for a routed batch
        if b.routes.shape[-1]:
            with replay.forcing(b.routes, b.input_ids.shape[1]):
                return model(input_ids=b.input_ids, attention_mask=b.attention_mask)
        return model(input_ids=b.input_ids, attention_mask=b.attention_mask)

    return forward


@pytest.mark.parametrize("mode", ["off", "r3"])
def test_disagreement_is_measured_on_on_policy_tokens_before_the_update(mode: str) -> None:
    model = tiny_moe()
    replay = RouteReplay(model, mode)
    rng = np.random.default_rng(0)
    routes = [[pack_routes(np.stack([rng.choice(8, 2, replace=False) for _ in range(2)])[None], SHAPE)
               for _ in range(3)] for _ in range(2)]
    full = _batch(routes)
    base = model(input_ids=full.input_ids).logits
    comm = type("C", (), {"world": 1})()
    assert replay.prepare(full, _forward(model, replay), chunk=1, version=1) is full
    m = replay.metrics(comm, torch.device("cpu"))
    assert "moe/disagree" not in m and 0.0 < m["moe/disagree_all"] <= 1.0  # no on-policy token (version 1)
    replay.prepare(full, _forward(model, replay), chunk=1, version=0)
    m = replay.metrics(comm, torch.device("cpu"))
    assert 0.0 < m["moe/disagree"] <= 1.0 and m["moe/compared_tokens"] == 6.0 and "moe/disagree/layer1" in m
    out = _forward(model, replay)(full).logits
    if mode == "off":  # compared only: the router routes itself
        torch.testing.assert_close(out, base)
    else:
        assert not torch.allclose(out, base)
    assert replay.metrics(comm, torch.device("cpu"))["moe/replayed"] == (0.0 if mode == "off" else 1.0)


def test_r2_records_the_trainers_own_routes_then_replays_them() -> None:
    model = tiny_moe()
    replay = RouteReplay(model, "r2")
    full = _batch()
    full2 = replay.prepare(full, _forward(model, replay), chunk=1, version=0)
    own = replay.decode(full2.routes)
    assert (own[0, 0] == -1).all() and (own[0, 1:] >= 0).all()  # the generated tokens' positions only
    base = model(input_ids=full.input_ids).logits
    with replay.forcing(full2.routes, full.input_ids.shape[1]):
        torch.testing.assert_close(model(input_ids=full.input_ids).logits, base)  # same weights: same routes


def test_r3_refuses_a_batch_with_a_generated_token_without_an_engine_route() -> None:
    """r3 asserts engine/trainer disagreement 0: every trained token replays the engine's route, so a generated
    token without one (a lost capture, a checkpoint saved without routes) is an error naming the fix."""
    model = tiny_moe()
    row = stand_in_routes(SHAPE, seed=1)
    full = [[row(1)[i * 4:(i + 1) * 4] for i in range(1)] * 3, [row(1)] * 2 + [b""]]
    for mode in ("off", "r2"):  # they route such a token themselves
        RouteReplay(model, mode).prepare(_batch(full), _forward(model, RouteReplay(model, "off")), 8, 0)
    with pytest.raises(RouteReplayError, match="r3: 1 of 6 generated tokens of step 0's batch have no engine route"):
        RouteReplay(model, "r3").prepare(_batch(full), lambda b: None, 8, 0)
    with pytest.raises(RouteReplayError, match="r3: 6 of 6"):
        RouteReplay(model, "r3").prepare(_batch(None), lambda b: None, 8, 0)


def test_replay_refuses_routes_of_another_layout() -> None:
    replay = RouteReplay(tiny_moe(), "r3")
    with pytest.raises(ValueError, match="routes of 3 bytes"):
        replay.decode(torch.zeros((1, 2, 3), dtype=torch.int16))
    model = tiny_moe()
    replay = RouteReplay(model, "r3")
    with pytest.raises(RouteReplayError, match="4 rows for routes of 5 positions"):
        with replay.forcing(_routes(1, 5, seed=0), 5):  # routes of a 5-token batch, a 4-token forward
            model(input_ids=torch.randint(2, 32, (1, 4)))


# --------------------------------------------------------------------------- the built-in model's folder
def test_builtin_moe_folder_keeps_the_char_tokenizer_and_checkpoint_layout(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashrl.models.moe import build_untrained_moe
    from flashrl.moe.model import MoeSpec
    from flashrl.moe.routes import route_shape
    from flashrl.moe.weights import checkpoint_layout

    out = build_untrained_moe(tmp_path / "m", spec=MoeSpec(expert_width=32))
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "12 + 3=\n4"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # qwen3_moe is not forced onto Qwen2's BPE
    assert route_shape(out) == (2, 8, 2)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    sd = checkpoint_layout(model, {k: v.detach() for k, v in model.state_dict().items()})
    disk = load_file(str(out / "model.safetensors"))
    assert set(sd) - {"lm_head.weight"} == set(disk)  # per-expert names, as vLLM's loader reads them
    assert all(torch.equal(sd[k], disk[k]) for k in disk)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in disk


# --------------------------------------------------------------------------- resume
def _routed(run: Any, seed: int = 0, routes: bool = True) -> Any:
    for i, e in enumerate(run.engines):
        e.routes = stand_in_routes(SHAPE, seed=seed + i) if routes else None
    run.controller.route_shape = SHAPE if routes else None
    return run


def test_a_resumed_run_trains_the_saved_routes_of_its_continued_rollouts(tmp_path: Path) -> None:
    """Stopped with rollouts in flight, resumed (the real checkpoint writer and reader: rollouts.msgpack):
    each continued rollout's trained routes start with the ones its checkpoint saved (as the engine chose them
    then, not the resumed engines' choice: those draw other routes here), one per response token, then the new
    engine's; the trainer's batch (pad_batch) puts each saved route at the position that sampled its token."""
    from flashrl.resuming import prepare_resume
    from tests.unit.test_resume_rollouts import Run, partial_cfg, snapshot_prefixes, tail_script

    cfg = partial_cfg(tmp_path)
    first = _routed(Run(cfg, FakeSuite(n_train=5, turns=1), stop_at_s=8.0, script=tail_script))
    first.go()
    r = prepare_resume(cfg)
    assert r.state.rollouts is not None
    prefixes = snapshot_prefixes(r.state.rollouts)
    assert prefixes and all(len(t.routes) == len(t.response_ids) for t in prefixes.values())
    for t in prefixes.values():
        check_routes(b"".join(t.routes), len(t.routes), SHAPE, "saved")
    second = _routed(Run(cfg, FakeSuite(n_train=5, turns=1), resume=r, script=tail_script), seed=100)
    s2 = second.go()
    assert s2.counters["resume/restored_routes"] >= sum(len(t.routes) for t in prefixes.values())
    assert s2.counters["resume/regenerated_tokens"] == 0
    trained = {x.sample_id: x for b in second.trainer.batches for x in b.samples}
    continued = [sid for sid in prefixes if sid in trained]
    assert continued
    for sid in continued:
        p, t = prefixes[sid], trained[sid]
        n = len(p.routes)
        assert len(t.routes) == len(t.response_ids) and t.routes[:n] == p.routes
        b = pad_batch([t], pad_id=0)
        start = len(t.prompt_ids) - 1
        got = b.routes[0, start:start + n].to(torch.uint8).numpy().tobytes()
        assert got == b"".join(p.routes)  # what the trainer replays (r3) for the restored tokens


def test_a_resume_regenerates_a_prefix_saved_without_routes_when_the_run_now_captures_them(tmp_path: Path) -> None:
    """A checkpoint of a run that captured no routes, resumed by one that does: the saved prefixes are generated
    again (counted), so that each of their trained tokens has the route that sampled it. (Samples that had
    finished come back as saved, without routes: off and r2 route them in the trainer, r3 refuses the batch,
    test_r3_refuses_a_batch_with_a_generated_token_without_an_engine_route.)"""
    from flashrl.resuming import prepare_resume
    from tests.unit.test_resume_rollouts import Run, partial_cfg, snapshot_prefixes, tail_script

    cfg = partial_cfg(tmp_path)
    _routed(Run(cfg, FakeSuite(n_train=5, turns=1), stop_at_s=8.0, script=tail_script), routes=False).go()
    r = prepare_resume(cfg)
    assert r.state.rollouts is not None
    prefixes = snapshot_prefixes(r.state.rollouts)
    assert prefixes and not any(t.routes for t in prefixes.values())
    second = _routed(Run(cfg, FakeSuite(n_train=5, turns=1), resume=r, script=tail_script))
    s2 = second.go()
    assert s2.counters["resume/regenerated_tokens"] >= sum(len(t.response_ids) for t in prefixes.values()) > 0
    assert "resume/restored_routes" not in s2.counters
    trained = {x.sample_id: x for b in second.trainer.batches for x in b.samples}
    again = [trained[sid] for sid in prefixes if sid in trained]
    assert again and all(len(x.routes) == len(x.response_ids) for x in again)


def test_simulated_moe_engines_carry_routes_through_the_controller(tmp_path: Path) -> None:
    """The simulator knows the routing payload: SimEngine answers with routes (builtin:moe's shape, or a MoE
    folder's), the rollouts check and keep them."""
    import json

    from flashrl.bench.simulate import moe_routes
    from flashrl.sim.engine import SimEngine
    from flashrl.wire.protocol import Generate

    cfg = msgspec.convert({"model": {"path": "builtin:moe"}}, Config)
    shape = moe_routes(cfg)
    assert shape == SHAPE and moe_routes(msgspec.convert({}, Config)) is None
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8}))
    assert moe_routes(msgspec.convert({"model": {"path": str(tmp_path)}}, Config)) == (48, 128, 8)
    assert moe_routes(msgspec.convert({"model": {"path": str(tmp_path)}, "moe": {"capture": "off"}}, Config)) is None
    eng = SimEngine("sim0", routes=shape)

    async def one() -> Any:
        return await eng.generate(Generate(request_id="r", prompt_ids=[5, 6, 7], max_tokens=6, temperature=1.0, seed=1))

    out = run_virtual(one).result
    assert len(route_rows(out.routes, len(out.token_ids), SHAPE, "sim0")) == len(out.token_ids) > 0


# --------------------------------------------------------------------------- the engine's experts after a reload
class _CpuExperts:
    isa = "vec"  # what marks vLLM's CPU experts (flashrl/moe/reload.py)

    def __init__(self, width: int) -> None:
        self.moe_config = type("Cfg", (), {"intermediate_size_per_partition": width})()
        self.packed = 0

    @staticmethod
    def _padded_intermediate_size(cfg: Any) -> int:
        return cfg.intermediate_size_per_partition

    def process_weights_after_loading(self, layer: Any) -> None:
        self.packed += 1


def _routed_experts(w13: torch.Tensor) -> Any:
    experts = _CpuExperts(w13.shape[1] // 2)
    mod = torch.nn.Module()
    mod.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
    mod.quant_method = type("QM", (), {"moe_kernel": type("K", (), {"fused_experts": experts})()})()
    root, layer, mlp, moe = torch.nn.Module(), torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    root.add_module("layer", layer)
    layer.add_module("mlp", mlp)
    mlp.add_module("experts", moe)
    moe.add_module("routed_experts", mod)  # "layer.mlp.experts.routed_experts", as in vLLM's Qwen3-MoE
    return root, experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_reload_left_unpacked_is_repacked_once_in_the_engines_dtype(dtype: torch.dtype) -> None:
    from flashrl.moe.reload import ExpertProbe, repack_cpu_experts

    gate, up = torch.randn(8, 16), torch.randn(8, 16)  # what the sync sends: float32, per expert
    named = [("layer.mlp.experts.0.gate_proj.weight", gate), ("layer.mlp.experts.0.up_proj.weight", up)]
    probe = ExpertProbe(named)
    assert list(probe) == named  # passed on unchanged
    raw = torch.cat([gate, up]).unsqueeze(0).to(dtype)  # what vLLM's reload leaves: unpacked, in the engine's dtype
    model, experts = _routed_experts(raw)
    assert repack_cpu_experts(model, probe) == 1 and experts.packed == 1
    model, experts = _routed_experts(raw.flip(-1))  # packed already (another layout): left alone
    assert repack_cpu_experts(model, probe) == 0 and experts.packed == 0


def test_moe_section_problems_name_the_fix() -> None:
    from flashrl.moe.routes import moe_problem

    def cfg(**moe: str) -> Config:
        return msgspec.convert({"moe": moe}, Config)

    assert moe_problem(cfg(), False, "builtin:tiny") == ""  # the default section fits any model
    assert moe_problem(cfg(replay="r3"), True, "builtin:moe") == ""
    assert moe_problem(cfg(replay="r3"), None, "/m") == ""  # a folder not built yet: checked at the run's start
    assert "not a Mixture-of-Experts" in moe_problem(cfg(replay="r2"), False, "builtin:tiny")
    assert "not a Mixture-of-Experts" in moe_problem(cfg(capture="on"), False, "/m")
    assert 'capture = "off"' in moe_problem(cfg(replay="r3", capture="off"), True, "builtin:moe")

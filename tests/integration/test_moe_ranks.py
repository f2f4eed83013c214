"""A Mixture-of-Experts policy trained by two FSDP2 ranks (gloo): builtin:moe, r3 routing replay, a real vLLM engine.

Checked: each rank holds half of every layer's experts (the DCP checkpoint's chunks of the fused expert tensors);
every routed position of every rank's forwards is forced to the engine's route (``moe/replayed`` summed over the
ranks is 1: one rank left routing itself would read about 0.5) and the trainer's own router agrees with the engine's
(float32 both sides); the weight sync gathers the sharded experts into vLLM's per-expert layout, checksums held (a
corrupted one refused): after the syncs the engine's logprobs equal the 2-rank trainer's recomputation.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from flashrl.config import load, to_toml
from flashrl.wire.protocol import Generate

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _expert_chunks(ckpt: Path) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Per fused expert tensor of the DCP checkpoint at ``ckpt``: its chunks' (offsets, sizes), in offset order."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k: sorted((list(c.offsets), list(c.sizes)) for c in v.chunks)  # type: ignore[union-attr]
            for k, v in md.items() if k.startswith("model.") and "mlp.experts." in k}


@pytest.mark.timeout(1200)
def test_two_ranks_shard_the_experts_replay_the_engines_routes_and_sync_them(tmp_path: Path) -> None:
    from envs import make_suite
    from flashrl.controller import Controller
    from flashrl.launch.processes import local_cluster
    from flashrl.models import ensure_model
    from flashrl.models.tokenizer import load_tokenizer
    from flashrl.moe.routes import check_routes, route_shape

    cfg = load(ROOT / "configs" / "moe.toml", [
        f"run.output_dir={tmp_path / 'runs'}", "run.name=ranks2", "run.dashboard=off", "run.max_time_s=0",
        "run.steps=3", "run.eval_every=0", "scheduler.async_ratio=0", "trainer.ranks=2", "trainer.lr=1e-3",
        "trainer.warmup_steps=0", "rollout.batch_prompts=16"])
    assert cfg.moe.replay == "r3" and cfg.model.dtype == "float32"
    model_dir = ensure_model(cfg)
    shape = route_shape(model_dir)
    assert shape == (2, 8, 2)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.toml").write_text(to_toml(cfg))
    tok = load_tokenizer(model_dir)
    records: list[dict] = []
    ckpt = tmp_path / "ckpt"

    async def main() -> None:
        async with local_cluster(cfg, model_dir, cfg.run_dir) as (engines, trainer):
            assert len(trainer.procs) == 2
            client = engines[0].client
            suite = make_suite(cfg.env.name, cfg.env.params, cfg.run.seed, cfg.env.eval_size)
            ctrl = Controller(cfg, tok, suite, [client], trainer, on_step=lambda r: records.append(r.to_dict()))
            ctrl.route_shape = shape
            await ctrl.run()
            assert await client.ping() == 3 and await trainer.ping() == 3
            for k, text in enumerate(("12+34=", "57+68=", "9+99=")):
                p = tok.encode(text)
                hot = await client.generate(Generate(request_id=f"t{k}", prompt_ids=p, max_tokens=4, temperature=0.7,
                                                     seed=k))
                assert hot.versions == [3] * len(hot.token_ids)
                check_routes(hot.routes, len(hot.token_ids), shape, "engine0")
                # the experts both ranks trained reached the engine: its logprobs are the trainer's recomputation
                assert await trainer.compute_logprobs(p, hot.token_ids) == pytest.approx(hot.logprobs, abs=2e-3)
            # a sync whose checksum does not match is refused; the engine keeps serving version 3
            manifest = await trainer.prepare_weights(4)
            bad = msgspec.structs.replace(manifest, buckets=[
                msgspec.structs.replace(b, checksum="0" * len(b.checksum)) for b in manifest.buckets])
            _, reply = await asyncio.gather(trainer.send_weights(4), client.update_weights(bad))
            assert reply.ok is False and "checksum" in reply.error
            assert await client.ping() == 3
            await trainer.save_checkpoint(ckpt)

    asyncio.run(main())
    steps = [r for r in records if r.get("step", 0) >= 1 and "grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    print("per step (mismatch/mean_abs, moe/disagree, moe/replayed):",
          [(r.get("mismatch/mean_abs"), r.get("moe/disagree"), r.get("moe/replayed")) for r in steps])
    for r in steps:
        assert r["moe/replayed"] == 1.0, r  # r3 on both ranks: every routed position forced to the engine's route
        assert r["moe/compared_tokens"] > 0 and r["moe/disagree"] <= 0.02, r  # float32: one network on both sides
    # sync: on-policy tokens, the same weights and routes on both sides (a step whose groups all tied trains no token
    # and compares none)
    compared = [r["mismatch/mean_abs"] for r in steps if "mismatch/mean_abs" in r]
    assert len(compared) >= 2 and max(compared) < 1e-3, compared
    # the engine says where its routes come from, and why (flashrl/moe/source.py): on the CPU, flashrl's hooks
    log = (cfg.run_dir / "logs" / "engine0.log").read_text()
    assert "capturing MoE routes (2 layers, 8 experts, top-2) from flashrl's hooks" in log
    assert "AuxOutput Connector requires Model Runner V2" in log
    chunks = _expert_chunks(ckpt)
    fused = {k: v for k, v in chunks.items() if k.endswith(("gate_up_proj", "down_proj"))}
    assert len(fused) == 2 * shape.layers, sorted(chunks)
    for name, parts in fused.items():  # FSDP2 shards dim 0, the experts: 4 of the 8 on each rank
        assert [(o[0], s[0]) for o, s in parts] == [(0, 4), (4, 4)], (name, parts)

"""A Mixture-of-Experts policy end to end: builtin:moe (Qwen3-MoE), real vLLM engine, real trainer, the real CLI.

Checked: configs/moe.toml learns (held-out accuracy up) with r3 routing replay on every training forward;
the engine captures routes through flashrl's worker extension (every generated token has one, well formed,
the router's own choice on the trainer's side for the same weights agrees); the weight sync reaches the
engine's experts (after syncs, the engine's logprobs equal the trainer's recomputation); the exported final
policy decodes greedily exactly as the last engine did.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from flashrl.config import load, to_toml
from flashrl.metrics import read_jsonl
from flashrl.wire.protocol import Generate

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _cfg(tmp_path: Path, *sets: str):
    return load(ROOT / "configs" / "moe.toml", [f"run.output_dir={tmp_path / 'runs'}", "run.dashboard=off",
                                                "run.max_time_s=0", *sets])


@pytest.mark.timeout(1500)
def test_moe_toml_learns_with_r3_replay(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "moe.toml"),
                           "--set", f"run.output_dir={tmp_path / 'runs'}", "--set", "run.steps=40",
                           "--set", "run.eval_every=40", "--set", "run.dashboard=plain", "--set", "run.max_time_s=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    rows = read_jsonl(tmp_path / "runs" / "moe" / "metrics.jsonl")
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    train = [r for r in rows if "grad_norm" in r]
    print("evals:", evals)
    assert evals[0][0] == 0 and evals[-1][0] == 40
    assert evals[-1][1] >= evals[0][1] + 0.10, evals  # 52% -> 77-80% at 40-60 steps on seed 0
    assert len(train) == 40 and all(r["moe/replayed"] == 1.0 for r in train)  # r3: every routed position forced
    measured = [r for r in train if "moe/disagree" in r]
    assert measured and all(r["moe/disagree"] <= 0.05 for r in measured), [r["moe/disagree"] for r in measured]


@pytest.mark.timeout(1200)
def test_moe_engine_routes_sync_and_export_decode_like_the_engine(tmp_path: Path) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from envs import make_suite
    from flashrl.controller import Controller
    from flashrl.launch.processes import local_cluster
    from flashrl.models import ensure_model
    from flashrl.models.export import export_run
    from flashrl.models.tokenizer import load_tokenizer
    from flashrl.moe.routes import check_routes, route_shape, unpack_routes

    cfg = _cfg(tmp_path, "run.steps=3", "run.eval_every=0", "scheduler.async_ratio=0", "run.name=sync",
               "trainer.lr=1e-3", "trainer.warmup_steps=0")
    model_dir = ensure_model(cfg)
    shape = route_shape(model_dir)
    assert shape == (2, 8, 2)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.toml").write_text(to_toml(cfg))
    tok = load_tokenizer(model_dir)
    records: list[dict] = []
    prompts = [tok.encode(p) for p in ("12+34=", "57+68=", "9+99=", "71+18=", "45+45=")]
    greedy: list[list[int]] = []
    sampled: list[Generate] = []

    async def main() -> None:
        async with local_cluster(cfg, model_dir, cfg.run_dir) as (engines, trainer):
            client = engines[0].client
            suite = make_suite(cfg.env.name, cfg.env.params, cfg.run.seed, cfg.env.eval_size)
            ctrl = Controller(cfg, tok, suite, [client], trainer, on_step=lambda r: records.append(r.to_dict()))
            ctrl.route_shape = shape
            await ctrl.run()
            for k, p in enumerate(prompts):
                hot = await client.generate(Generate(request_id=f"t{k}", prompt_ids=p, max_tokens=4, temperature=0.7,
                                                     seed=k))
                assert hot.versions == [3] * len(hot.token_ids)
                check_routes(hot.routes, len(hot.token_ids), shape, "engine0")  # one well-formed route per token
                sampled.append(hot)
                assert len(np.unique(unpack_routes(hot.routes, shape))) > 2
                # the synced experts: the engine's logprobs (at the training temperature) are the trainer's recomputation
                assert await trainer.compute_logprobs(p, hot.token_ids) == pytest.approx(hot.logprobs, abs=2e-3)
                g = await client.generate(Generate(request_id=f"g{k}", prompt_ids=p, max_tokens=4, temperature=0.0))
                greedy.append(g.token_ids)
            # an aborted request (a checkpoint cut, a partial rollout) answers with the routes of the tokens it has
            for wait in (0.1, 0.05, 0.02, 0.01, 0.005):  # until one is cut with tokens (the engine's speed varies)
                long = asyncio.ensure_future(client.generate(Generate(
                    request_id=f"long{wait}", prompt_ids=prompts[0], max_tokens=50, temperature=1.0, seed=9, ignore_eos=True)))
                await asyncio.sleep(wait)
                await client.abort([f"long{wait}"])
                cut = await long
                check_routes(cut.routes, len(cut.token_ids), shape, "engine0")
                if cut.finish_reason == "abort" and cut.token_ids:
                    break
            print("the aborted request:", len(cut.token_ids), "tokens,", cut.finish_reason)
            await trainer.save_model(cfg.run_dir / "final")

    asyncio.run(main())
    steps = [r for r in records if r.get("step", 0) >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    print("mismatch/mean_abs, moe/disagree per step:", [(r["mismatch/mean_abs"], r["moe/disagree"]) for r in steps])
    # sync mode: every token on-policy; the engine holds the trainer's weights (synced experts included), and the
    # trainer replays the engine's routes: the logprobs agree
    assert all(r["mismatch/mean_abs"] < 1e-3 and r["moe/replayed"] == 1.0 for r in steps), steps
    out, _ = export_run(cfg.run_dir, tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    before = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    moved = [n for n, p in model.named_parameters() if "experts" in n and not torch.equal(p, before.get_parameter(n))]
    assert moved, "the experts did not train"
    # the captured routes are the router's choice: transformers' router over the same tokens, same weights
    caught: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, a, o: caught.append(o[2]))
    for p, hot in zip(prompts, sampled):
        caught.clear()
        with torch.no_grad():
            model(input_ids=torch.tensor([p + hot.token_ids]))
        hf = torch.stack(caught, 1).sort(-1).values.numpy()[len(p) - 1: len(p) - 1 + len(hot.token_ids)]
        assert (hf == unpack_routes(hot.routes, shape)).all()
    for p, want in zip(prompts, greedy):
        got = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=4, do_sample=False)
        assert got[0, len(p):].tolist()[: len(want)] == want


@pytest.mark.timeout(1500)
def test_a_resumed_moe_run_replays_the_routes_saved_with_its_rollouts(tmp_path: Path) -> None:
    """`flashrl run configs/moe.toml` (r3, async, partial rollouts) stopped by SIGTERM after a few steps: its
    checkpoint keeps the untrained rollouts (finished ones and ones cut mid-generation) with one well-formed engine
    route per generated token; `--resume` restores them (resume/restored_routes counts every saved route),
    continues the cut ones, regenerates nothing, and its trainer replays them: r3 refuses any trained token
    without an engine route (RouteReplayError), every routed position of the first resumed step's forwards is
    forced, and the trainer's own router agrees with the replayed routes of that step's tokens."""
    import os
    import signal
    import time

    import msgspec

    from flashrl.checkpoint import ROLLOUTS_FILE, RolloutSnapshot, read_latest
    from flashrl.moe.routes import RouteShape, check_routes

    # hot, long answers (temperature 2, up to 40 tokens): generation is still going on when the stop cuts it
    sets = ["--set", f"run.output_dir={tmp_path / 'runs'}", "--set", "run.name=res", "--set", "run.eval_every=0",
            "--set", "run.dashboard=plain", "--set", "run.max_time_s=0", "--set", "rollout.temperature=2.0",
            "--set", "rollout.max_new_tokens=40", "--set", "run.checkpoint_every=0"]
    cmd = [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "moe.toml"), *sets]
    run_dir = tmp_path / "runs" / "res"
    proc = subprocess.Popen([*cmd, "--set", "run.steps=400"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").exists() and any(r.get("step", 0) >= 3 for r in read_jsonl(run_dir / "metrics.jsonl")):
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:] if proc.stdout else ""
        proc.send_signal(signal.SIGTERM)  # finish the step, cut the rollouts in flight, checkpoint, exit 130
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = proc.stdout.read().decode() if proc.stdout else ""
    assert proc.returncode == 130, out[-3000:]
    ckpt = read_latest(run_dir / "checkpoints")
    assert ckpt is not None
    snap = msgspec.msgpack.decode((ckpt / ROLLOUTS_FILE).read_bytes(), type=RolloutSnapshot)
    shape = RouteShape(2, 8, 2)
    saved = [t for g in snap.groups for t in (*g.samples, *g.held, *g.unfinished) if t.response_ids]
    cut = [t for g in snap.groups for t in g.unfinished if t.response_ids]
    assert cut, "no rollout was cut with tokens at the stop: the test shows nothing"
    for t in saved:  # one route per generated token, as the engine captured it
        assert len(t.routes) == len(t.response_ids), t.sample_id
        check_routes(b"".join(t.routes), len(t.routes), shape, f"checkpoint {t.sample_id}")
    stopped = snap.version
    second = subprocess.run([*cmd, "--set", f"run.steps={stopped + 2}", "--resume"], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) > stopped and "grad_norm" in r]
    assert [r["step"] for r in rows] == [stopped + 1, stopped + 2]
    last = rows[-1]
    assert last["count/resume/restored_routes"] == sum(len(t.routes) for t in saved)
    assert last["count/resume/regenerated_tokens"] == 0
    assert last["count/resume/restored_rollouts"] == sum(len(g.unfinished) for g in snap.groups) > 0
    first = rows[0]
    assert first["moe/replayed"] == 1.0  # r3: every position with a route forced to it, the restored ones included
    # the restored tokens (older versions) are compared in moe/disagree_all: their saved routes are the engine's
    # routes of those tokens, which the float32 trainer's router reproduces (routes zeroed, shifted or of other
    # tokens would disagree on most of them)
    assert first["moe/disagree_all"] <= 0.05, first


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "cpu_mixed_precision"])
def test_cpu_mixed_precision_computes_in_the_model_dtype_over_float32_masters(tmp_path: Path, mixed: bool) -> None:
    """trainer.cpu_mixed_precision (the real Trainer, one gloo rank in this process): with model.dtype bfloat16
    the routers (and every layer) compute in bfloat16 while the weights the optimizer updates stay float32;
    without it the CPU trainer computes in float32 whatever model.dtype says."""
    import torch

    from flashrl.config import from_dict
    from flashrl.models.moe import build_untrained_moe
    from flashrl.moe.capture import router_modules
    from flashrl.moe.model import MoeSpec
    from flashrl.trainer.worker import Trainer
    from flashrl.wire.protocol import TrainBatch
    from flashrl.wire.trajectory import Trajectory

    model_dir = build_untrained_moe(tmp_path / "m", seed=0, spec=MoeSpec(layers=1, experts=4))
    cfg = from_dict({"run": {"output_dir": str(tmp_path), "name": "r"}, "model": {"path": str(model_dir), "dtype": "bfloat16"},
                     "trainer": {"backend": "gloo", "lr": 1e-2, "threads": 1, "warmup_steps": 0,
                                 "cpu_mixed_precision": mixed}})
    t = Trainer(cfg, str(model_dir), torch.device("cpu"))
    seen: list[torch.dtype] = []
    for _, gate in router_modules(t.model):
        gate.register_forward_hook(lambda m, a, o: seen.append(a[0].dtype))
    def full(p: torch.Tensor) -> torch.Tensor:  # a sharded (FSDP2) parameter is a DTensor
        return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()

    before = {n: full(p).clone() for n, p in t.model.named_parameters()}
    samples = [Trajectory(prompt_ids=[1, 12, 5, 13], response_ids=r, loss_mask=[1] * len(r), behav_logp=[-3.0] * len(r),
                          versions=[0] * len(r), reward=float(i % 2), group=0, sample_id=str(i))
               for i, r in enumerate(([7, 8, 2], [9, 10, 11, 2], [7, 9, 2], [10, 2]))]
    t.train_step(TrainBatch(step=0, samples=samples))
    assert seen and set(seen) == {torch.bfloat16 if mixed else torch.float32}
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # the masters
    assert any(not torch.equal(full(p), before[n]) for n, p in t.model.named_parameters())  # it trained

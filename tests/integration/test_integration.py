"""The real parts together: vLLM engine processes, a 2-rank FSDP2 trainer group on gloo, ZeroMQ, the controller.

These start real processes (tens of seconds each on 2 cores), so they are marked slow; CI runs them.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from flashrl.config import load, to_toml
from flashrl.metrics import read_jsonl
from flashrl.wire.protocol import Generate

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _listening(procs: list[psutil.Process]) -> set[str]:
    """The addresses the TCP sockets of ``procs`` listen on."""
    return {c.laddr.ip for p in procs for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


@pytest.mark.timeout(1200)
def test_engine_and_trainer_group_train_and_sync(tmp_path: Path) -> None:
    """A few real steps; then the engine's logprobs equal the trainer's (greedy and at T = 0.7), versions
    advanced, checksums enforced."""
    from envs import make_suite
    from flashrl.controller import Controller
    from flashrl.launch.processes import local_cluster
    from flashrl.models.tiny import build_untrained
    from flashrl.models.tokenizer import load_tokenizer

    model = build_untrained(tmp_path / "model", seed=0)
    cfg = load(
        ROOT / "configs" / "tiny.toml",
        [
            f"run.output_dir={tmp_path}", "run.name=it", "run.steps=2", "run.eval_every=0", "run.dashboard=off",
            "engine.count=1", "trainer.ranks=2", "env.eval_size=8", "rollout.batch_prompts=2", "rollout.group_size=4",
            "scheduler.async_ratio=1",
        ],
    )
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.toml").write_text(to_toml(cfg))
    tok = load_tokenizer(model)
    records: list[dict] = []

    async def main() -> None:
        async with local_cluster(cfg, model, cfg.run_dir) as (engines, trainer):
            client = engines[0].client
            suite = make_suite(cfg.env.name, cfg.env.params, cfg.run.seed, cfg.env.eval_size)
            await Controller(cfg, tok, suite, [client], trainer, on_step=lambda r: records.append(r.to_dict())).run()
            # The trainer's default group and the weight-sync group listen on loopback only (rank 0 hosts
            # both stores; every rank and the engine's vLLM worker have gloo sockets), never on a
            # wildcard address.
            for rank, p in enumerate(trainer.procs):
                assert _listening([psutil.Process(p.pid)]) == {"127.0.0.1"}, rank
            engine = psutil.Process(engines[0].proc.pid)
            assert _listening([engine, *engine.children(recursive=True)]) <= {"127.0.0.1"}
            assert await client.ping() == 2  # two updates reached the engine
            assert await trainer.ping() == 2

            prompt = tok.encode("12+34=")
            gen = await client.generate(Generate(request_id="fixed", prompt_ids=prompt, max_tokens=6, temperature=0.0))
            assert gen.token_ids and gen.versions == [2] * len(gen.token_ids)
            ref = await trainer.compute_logprobs(prompt, gen.token_ids, temperature=0.0)
            assert ref == pytest.approx(gen.logprobs, abs=2e-3)

            # Sampled at the config's temperature (0.7): the engine returns the logprobs of the tempered
            # distribution it sampled from, and the trainer's recomputation (the one behind proximal and
            # current logprobs) scores the same; temperature-1 (raw) logprobs would be far off.
            assert cfg.rollout.temperature == 0.7 and cfg.rollout.top_p == 1.0
            for seed in range(3):
                hot = await client.generate(Generate(request_id=f"t{seed}", prompt_ids=prompt, max_tokens=12,
                                                     temperature=0.7, seed=seed, ignore_eos=True))
                mine = await trainer.compute_logprobs(prompt, hot.token_ids)
                raw = await trainer.compute_logprobs(prompt, hot.token_ids, temperature=1.0)
                assert mine == pytest.approx(hot.logprobs, abs=2e-3)
                assert max(abs(a - b) for a, b in zip(raw, hot.logprobs)) > 0.05

            # a sync whose checksum does not match is refused and the engine keeps serving version 2
            manifest = await trainer.prepare_weights(3)
            bad = msgspec.structs.replace(manifest, buckets=[msgspec.structs.replace(b, checksum="0" * len(b.checksum)) for b in manifest.buckets])
            _, reply = await asyncio.gather(trainer.send_weights(3), client.update_weights(bad))
            assert reply.ok is False and "checksum" in reply.error
            again = await client.generate(Generate(request_id="fixed2", prompt_ids=prompt, max_tokens=6, temperature=0.0))
            assert again.versions == [2] * len(again.token_ids)
            assert again.logprobs == pytest.approx(gen.logprobs, abs=1e-5)

    asyncio.run(main())
    steps = [r for r in records if r.get("step", 0) >= 1 and "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # the default mode (scheduler.stale = partial): nothing dropped, its bound held (core/staleness.py)
        assert r["dropped/samples"] == 0 and "count/stale/over_bound_groups" not in r
        # 2 prompts x 4 samples, each rewarded 0 or 1 by the exact verifier
        assert r["samples"] == 8 and r["reward/mean"] * 8 == pytest.approx(round(r["reward/mean"] * 8))
        assert r["time/weight_sync_s"] > 0


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_run_writes_metrics_and_stops_cleanly_on_signal(tmp_path: Path, sig: signal.Signals) -> None:
    """`flashrl run` trains (metrics.jsonl, resolved config, logs), then a signal stops every process within 30 s."""
    cmd = [
        sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"),
        "--set", f"run.output_dir={tmp_path}", "--set", "run.name=sig", "--set", "run.steps=100000",
        "--set", "run.eval_every=2", "--set", "env.eval_size=16", "--set", "run.dashboard=plain",
    ]
    stores_before = set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))  # vLLM's file:// store of a process group
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    metrics = tmp_path / "sig" / "metrics.jsonl"
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:] if proc.stdout else ""
            if metrics.exists() and any(r.get("step", 0) >= 2 for r in read_jsonl(metrics)):
                break
            time.sleep(1)
        else:
            pytest.fail("no training step within 900 s")
        children = _descendants(proc.pid)
        assert len(children) >= 2  # the engine (vLLM runs inside it) and the trainer rank
        t0 = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = proc.stdout.read().decode() if proc.stdout else ""
    assert took < 30
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted: all processes stopped" in out
    assert "leaked" not in out  # no native-extension leak reports at exit (the frozen GC generation is released)
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"orphans: {[(c.pid, c.cmdline()) for c in alive]}"

    run_dir = tmp_path / "sig"
    # nor files: the engine process ends with procs.exit_now (no exit hooks, vLLM's included), after
    # InprocEngine.shutdown tore vLLM's distributed state down, whose store keeps a file in the temp dir
    assert set(Path(tempfile.gettempdir()).glob("vllm_dist_*")) <= stores_before
    assert load(run_dir / "config.toml").run.name == "sig"
    assert {"controller.log", "engine0.log", "trainer0.log"} <= {p.name for p in (run_dir / "logs").iterdir()}
    rows = read_jsonl(metrics)
    # step 0 evaluates the warm-started built-in model (docs/benchmarks.md: ~55% greedy) on the 16 held-out items
    acc = rows[0]["eval/accuracy"]
    assert rows[0]["step"] == 0 and acc * 16 == pytest.approx(round(acc * 16)) and acc >= 0.25
    trained = [r for r in rows if r["step"] >= 1]
    for r in trained:
        for key in ("step", "reward/mean", "time/step_s", "staleness/mean"):
            assert key in r, key
    assert any("eval/accuracy" in r for r in trained if r["step"] == 2)
    # plain progress lines when stdout is not a terminal (one per dashboard refresh that saw a new step:
    # steps finishing within one refresh share a line, so which steps get one depends on the timing)
    assert re.search(r"^step \d+/100000 ", out, re.M), out[-3000:]
    # the signal let the step in progress finish and wrote a checkpoint of it (resume: --resume)
    from flashrl.resuming import find_checkpoint

    ck = find_checkpoint(run_dir)
    assert f"checkpoint {ck.path} written" in out
    last = max(r["step"] for r in trained)
    # metrics.jsonl holds every emitted step; a step still waiting for its eval when the signal came
    # is not lost: its record travels in the checkpoint and a resumed run writes it (no gap, no repeat)
    # (its eval may also finish after the checkpoint and reach metrics.jsonl: resume cuts the file back to
    # metrics_through and writes the pending record once)
    st = ck.state
    assert st.metrics_through <= last <= ck.step
    if st.metrics_through < ck.step:
        assert ck.step == st.metrics_through + 1 and st.pending_record is not None
        assert st.pending_record["step"] == ck.step

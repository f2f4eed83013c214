"""`flashrl bench` as a typer sub-application (flashrl/bench/cli.py): every command has its own --help, a bad
option or value is a usage error (exit 2) naming it, and each command hands the bench function the options
it was given, with the defaults the hand-parsed command line had. The bench functions themselves are
stood in for here (their own tests run them); nothing starts a process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from flashrl.bench.cli import SHIPPED, bench_app
from flashrl.cli import app

MODES = ["all", "scenario", "calibrate", "algorithms", "chaos", "chaos-scripted", "peers", "seeds", "steptime", "controller-profile"]
runner = CliRunner()


def _text(result: Any) -> str:
    """The output with rich's boxes and line wrapping taken out (an error box wraps long messages)."""
    return " ".join(result.output.replace("│", " ").split())


def test_bench_alone_shows_every_command() -> None:
    """`flashrl bench` alone and `flashrl bench --help` list the commands (every mode and shipped scenario)."""
    assert "queue_scheduling" in SHIPPED and "real_rlvr" in SHIPPED  # the package data was found
    assert not set(SHIPPED) & set(MODES)  # a scenario named like a command would hide it
    for args in (["bench"], ["bench", "--help"]):
        result = runner.invoke(app, args, terminal_width=200)
        assert "Usage:" in result.output and "COMMAND" in result.output
        for name in [*MODES, *SHIPPED]:
            assert f" {name} " in result.output, name
    assert runner.invoke(app, ["bench", "--help"]).exit_code == 0


@pytest.mark.parametrize("name", [*MODES, *sorted(SHIPPED)])
def test_every_command_has_its_own_help(name: str) -> None:
    """`flashrl bench NAME --help`: the command's usage line and every option it takes."""
    import typer.main

    command = typer.main.get_command(bench_app).commands[name]  # type: ignore[attr-defined]
    options = [p.opts[0] for p in command.params if p.param_type_name == "option"]
    assert "--help" not in options and len(options) >= 1
    result = runner.invoke(app, ["bench", name, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert f"bench {name} [OPTIONS]" in result.output
    for opt in options:
        assert opt in result.output, (name, opt)


@pytest.mark.parametrize("name", [*MODES, "queue_scheduling"])
def test_an_unknown_option_is_a_usage_error(name: str) -> None:
    result = runner.invoke(bench_app, [name, "--no-such-option"])
    assert result.exit_code == 2
    assert "No such option: --no-such-option" in _text(result)


@pytest.mark.parametrize("args, message", [
    (["nope"], "no bench command or shipped scenario 'nope'"),
    (["queue_scheduling", "--mode", "fast"], "'fast' is not one of 'sim', 'real'"),
    (["queue_scheduling", "--steps", "0"], "--steps"),
    (["peers", "--seeds", "0,x"], "give comma-separated integers"),
    (["seeds", "--sync-seeds", "one"], "--sync-seeds"),
    (["peers", "--targets", "80"], "give fractions in (0, 1]"),
    (["peers", "--targets", "half"], "give fractions like 0.5"),
    (["algorithms", "--ratios", "0,two"], "--ratios"),
    (["algorithms", "--losses", ","], "give at least one loss"),
    (["calibrate"], "Missing argument"),
    (["calibrate", "a", "b"], "add --cross"),
    (["calibrate", "runs/x", "--fit", "real_rlvr/base"], "--fit chooses the fitted run of --cross"),
    (["calibrate", "--cross", "r.json", "--no-predict"], "apply to a run directory, not to --cross"),
    (["steptime", "--compare"], "give the profiles to compare"),
    (["steptime", "a.json"], "without --compare"),
    (["chaos-scripted", "--kill-every", "soon"], "Invalid value for '--kill-every'"),
    (["chaos", "--every", "60-30"], "give seconds between kills as LO-HI"),
    (["chaos", "--every", "soon"], "give seconds between kills as LO-HI"),
    (["chaos", "--baseline", "--baseline-dir", "x"], "not both"),
    (["chaos", "--baseline-dir", "no/such/run"], "no metrics.jsonl"),
])
def test_a_bad_value_names_the_option(args: list[str], message: str) -> None:
    result = runner.invoke(bench_app, args)
    assert result.exit_code == 2, result.output
    assert message in _text(result)


def _capture(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, ret: Any) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []

    def fake(*args: Any, **kwargs: Any) -> Any:
        calls.append((*args, kwargs))
        return ret(*args, **kwargs) if callable(ret) else ret

    monkeypatch.setattr(module, name, fake)
    return calls


def test_sweeps_pass_their_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from flashrl.bench import sweep

    calls = _capture(monkeypatch, sweep, "run_sweep", 0)
    own = tmp_path / "mine.toml"
    own.write_text("")
    for args in (["queue_scheduling"], ["all"], ["all", "--mode", "real", "--out", "o"],
                 ["scenario", str(own), "--steps", "40"], [str(own), "--mode", "sim"]):
        assert runner.invoke(bench_app, args).exit_code == 0
    assert [c[:4] for c in calls] == [("queue_scheduling", "bench/results", None, None), ("all", "bench/results", "sim", None),
                                      ("all", "o", "real", None), (str(own), "bench/results", None, 40),
                                      (str(own), "bench/results", "sim", None)]
    monkeypatch.setattr(sweep, "run_sweep", lambda *a: 1)  # a point missed its bar
    assert runner.invoke(bench_app, ["scaling"]).exit_code == 1


def test_a_scenario_that_is_not_there_is_named(tmp_path: Path) -> None:
    result = runner.invoke(bench_app, ["scenario", str(tmp_path / "gone")])
    assert result.exit_code == 2 and "not found: give a .toml path or one of" in _text(result)


def _fake_bench(modes: list[str], seeds: list[int], out: str, *a: Any, **k: Any) -> list[Any]:
    """run_bench's stand-in: writes the results.md the CLI prints, returns completed runs."""
    from flashrl.bench.peers.report import Run

    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "results.md").write_text("# table\n")
    return [Run(mode=m, seed=s, name="x", returncode=0) for m in modes for s in seeds]


def test_peers_and_seeds_keep_their_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from flashrl.bench.peers import runner as peers_runner

    calls = _capture(monkeypatch, peers_runner, "run_bench", _fake_bench)
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(bench_app, ["peers"]).exit_code == 0
    assert runner.invoke(bench_app, ["seeds", "--seeds", "3,4", "--sync-seeds", "all", "-s", "a=1", "--resume"]).exit_code == 0
    (modes, seeds, out, config, steps, sets, timeout, kw), (modes2, seeds2, out2, *_, kw2) = calls
    assert (modes, seeds, out, config, steps, sets, timeout) == (
        ["trl", "async", "sync"], [0], "bench/results/peers", "configs/tiny.toml", None, [], None)
    assert kw == {"title": "flashrl vs TRL GRPOTrainer", "sync_seeds": [0], "resume": False, "report_only": False,
                  "targets": None, "variants": {}, "clock_from": None, "trl_python": ".venv-trl/bin/python"}
    assert (modes2, seeds2, out2) == (["async"], [3, 4], "bench/results/seeds")
    assert kw2["sync_seeds"] == [3, 4] and kw2["resume"] and calls[1][5] == ["a=1"]
    assert runner.invoke(bench_app, ["peers", "--targets", "0.5,0.6"]).exit_code == 0
    assert calls[2][-1]["targets"] == [0.5, 0.6]
    knobs = ["seeds", "--modes", "sync,envasync", "--variant", "envasync=scheduler.async_ratio=0; rollout.env_async=true",
             "--variant", "all="]
    assert runner.invoke(bench_app, knobs).exit_code == 0
    assert calls[3][-1]["variants"] == {"envasync": ["scheduler.async_ratio=0", "rollout.env_async=true"], "all": []}
    bad_variant = runner.invoke(bench_app, ["seeds", "--variant", "sync=rollout.redundancy=2"])
    assert bad_variant.exit_code == 2 and "'sync' is a built-in mode" in _text(bad_variant)
    monkeypatch.setattr(peers_runner, "run_bench", lambda *a, **k: (_ for _ in ()).throw(ValueError("--modes x: give")))
    bad = runner.invoke(bench_app, ["peers", "--modes", "x"])
    assert bad.exit_code == 2 and "flashrl bench peers: --modes x" in _text(bad)


def test_chaos_names_the_command_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrl.bench import chaos, chaos_report

    calls = _capture(monkeypatch, chaos, "run_chaos", 0)
    args = ["chaos-scripted", "configs/x.toml", "--kill-every", "30", "-s", "a=1", "--set", "b=2"]
    assert runner.invoke(bench_app, args).exit_code == 0
    ((config, out, command, kw),) = calls
    assert (config, out) == ("configs/x.toml", "bench/results/chaos")
    assert command == "flashrl bench chaos-scripted configs/x.toml --kill-every 30.0 --set a=1 --set b=2"
    assert kw == {"kill_every": 30.0, "controller_kill_after": 150.0, "sync_kill": 1, "engine_kills": -1,
                  "min_gain": chaos_report.MIN_GAIN_POINTS, "end_after": None, "sets": ["a=1", "b=2"], "timeout_s": 1800.0}


def test_chaos_hands_its_options_and_names_its_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrl.bench import chaos_soak

    calls = _capture(monkeypatch, chaos_soak, "run_soak", 0)
    assert runner.invoke(bench_app, ["chaos"]).exit_code == 0
    args = ["chaos", "--config", "configs/tiny.toml", "--minutes", "3", "--every", "20-30", "--seed", "4", "-s", "a=1"]
    assert runner.invoke(bench_app, args).exit_code == 0
    (config, out, command, kw), (config2, out2, command2, kw2) = calls
    assert (config, out, command) == ("configs/tools.toml", "bench/results/chaos-all", "flashrl bench chaos")
    assert kw == {"minutes": 30.0, "every": (30.0, 60.0), "seed": 0, "baseline": False, "baseline_dir": None,
                  "steps": None, "sets": [], "timeout_s": None}
    assert command2 == "flashrl bench chaos --config configs/tiny.toml --minutes 3.0 --seed 4 --every 20-30 --set a=1"
    assert kw2["every"] == (20.0, 30.0) and kw2["seed"] == 4 and kw2["sets"] == ["a=1"]


def test_chaos_report_only_runs_nothing_whatever_the_report_says(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """--report-only computes the report again and never starts a run: run_soak clears --out first, so a run
    after a passing report wiped the records it had just reported on (it did, once)."""
    from flashrl.bench import chaos_soak

    runs = _capture(monkeypatch, chaos_soak, "run_soak", 0)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    for code in (0, 1):
        again = _capture(monkeypatch, chaos_soak, "report_again", code)
        res = runner.invoke(bench_app, ["chaos", "--report-only", "--out", "o", "--baseline-dir", str(tmp_path)])
        assert res.exit_code == code and len(again) == 1 and runs == []
    bad = runner.invoke(bench_app, ["chaos", "--report-only", "--baseline"])
    assert bad.exit_code == 2 and "give the undisturbed run as --baseline-dir" in _text(bad) and runs == []


def test_algorithms_and_steptime_keep_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrl.bench import algorithms, steptime

    alg = _capture(monkeypatch, algorithms, "run_algorithms_bench", [])
    monkeypatch.setattr(algorithms, "markdown_table", lambda points: "table")
    assert runner.invoke(bench_app, ["algorithms"]).exit_code == 0
    (losses, ratios, steps, out, config, kw), = alg
    assert (losses, ratios, steps, out, config) == (
        ["ppo", "decoupled_ppo", "tis", "topr", "cispo", "gspo"], [0, 2, 8], 100, "bench/results/algorithms",
        "configs/tiny.toml")
    assert kw == {"extra_sets": [], "timeout_s": None, "resume": False}

    prof = _capture(monkeypatch, steptime, "run_profile", {})
    monkeypatch.setattr(steptime, "table", lambda results: "table\n")
    result = runner.invoke(bench_app, ["steptime"])
    assert result.exit_code == 0 and "bench steptime: bench/results/steptime/steptime.json" in result.output
    assert prof[0][:-1] == ("configs/tiny.toml", 60, "steptime", Path("bench/results/steptime"), [], 5, 1800.0, None)


def test_steptime_compare_reads_the_files_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrl.bench import steptime

    seen: list[Any] = []
    monkeypatch.setattr(steptime, "table", lambda results: seen.append(results) or "table\n")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text('{"label": "a"}')
    b.write_text('{"label": "b"}')
    assert runner.invoke(bench_app, ["steptime", "--compare", str(a), str(b)]).exit_code == 0
    assert seen == [[{"label": "a"}, {"label": "b"}]]
    missing = runner.invoke(bench_app, ["steptime", "--compare", str(tmp_path / "c.json")])
    assert missing.exit_code == 2 and "c.json" in _text(missing)


def test_controller_profile_passes_its_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrl.bench import overhead

    calls = _capture(monkeypatch, overhead, "profile_controller", "hot functions")
    result = runner.invoke(bench_app, ["controller-profile", "--engines", "2", "--steps", "3"])
    assert result.exit_code == 0 and "hot functions" in result.output
    assert calls == [(128, 8, 2, 3, 30, {})]


def test_peers_passes_clock_from(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from flashrl.bench.peers import runner as peers_runner

    calls = _capture(monkeypatch, peers_runner, "run_bench", _fake_bench)
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(bench_app, ["peers", "--report-only", "--clock-from", "timing"]).exit_code == 0
    assert calls[0][-1]["clock_from"] == "timing" and calls[0][-1]["report_only"]


def test_exit_ends_the_command_on_success_too() -> None:
    """``_exit(0)`` raises like ``_exit(1)``: a command that called it cannot go on to run anything else (the
    --report-only bug: a passing report fell through into a new bench that cleared the records)."""
    import typer

    from flashrl.bench.cli import _exit

    for code in (0, 1, 2):
        with pytest.raises(typer.Exit) as e:
            _exit(code)
        assert e.value.exit_code == code

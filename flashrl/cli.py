"""The `flashrl` command line (typer).

    flashrl run CONFIG [--set k=v ...]       train: engines + trainer group + controller (+ dashboard)
    flashrl validate CONFIG [--set k=v ...]  check a config only (exit 2 on any problem)
    flashrl init-model CONFIG                build / warm-start the built-in model (cached)
    flashrl samples RUN_DIR [--step N]       what the model wrote: rollouts and eval generations of a run
    flashrl export RUN_DIR --out DIR [--step N] [--adapter]  the trained policy as a Hugging Face folder
    flashrl doctor --gpu [--device cpu]     what runs on a GPU machine without vLLM: trainer step, packing, NCCL, DCP
    flashrl config-reference [--out FILE]   every config key: type, default, bounds, meaning (docs/configuration.md)
    flashrl bench COMMAND                    benchmarks: scenario sweeps, calibrate, algorithms, chaos, peers, ...
    flashrl run CONFIG --launcher slurm [--dry-run]  render runs/<name>/slurm/job.sbatch and submit it
    flashrl node CONFIG --node N             one node of a SLURM job (the job script runs it)
    flashrl engine ... / flashrl trainer ... process entry points (the launcher starts these)

Config problems exit with code 2 and one message naming the key path, before any process starts (a config
error found once the run began exits 2 too); a failure a restart would meet again (every judge engine down,
JudgeDown; an adapter vLLM keeps refusing, AdapterRefused) exits 3 (launch/driver.py final_failure), recorded in
runs/<name>/failure.json: --supervise stops at once and names it.
Heavy imports (torch, vLLM) happen inside the commands, so `validate` answers at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from flashrl.bench.cli import bench_app
from flashrl.config import Config, ConfigError, load

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False, help="flashrl: asynchronous RL post-training for LLMs.")

SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="override a config key: --set rollout.group_size=4 (repeatable)"),
]
ConfigArg = Annotated[Path, typer.Argument(help="config TOML, e.g. configs/tiny.toml")]


def _load_or_exit(config: Path | None, overrides: list[str] | None) -> Config:
    try:
        return load(config, overrides or [])
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(code=2) from None


def _check_env_or_exit(cfg: Config, config: Path) -> None:
    """The environment's own params struct checks [env.params], flashrl/envcheck.py the rest (WARM_START keys,
    a multi-turn env's rollout.max_turns); a problem exits 2 like any config error, a doubt is a warning."""
    from flashrl.envcheck import check_env

    try:
        notes = check_env(cfg)
    except ValueError as e:
        typer.echo(f"config error: {config}: {e}", err=True)
        raise typer.Exit(code=2) from None
    for note in notes:
        typer.echo(f"warning: {note}", err=True)


def _check_model_or_exit(cfg: Config, config: Path, build: bool = True) -> None:
    """A local model folder: its tokenizer loads and its chat template fits model.chat_template (exit 2).
    ``build`` False (validate): a folder [model.build] would build is noted, not built."""
    from flashrl.models import BUILTIN_MODELS, BUILTIN_MOE
    from flashrl.moe.routes import moe_problem, route_shape

    folder = Path(cfg.model.path).expanduser()
    moe = (cfg.model.path == BUILTIN_MOE if cfg.model.path in BUILTIN_MODELS else
           route_shape(folder) is not None if (folder / "config.json").is_file() else None)
    if problem := moe_problem(cfg, moe, cfg.model.path):
        typer.echo(f"config error: {config}: {problem}", err=True)
        raise typer.Exit(code=2)
    if cfg.model.path in BUILTIN_MODELS:
        return
    from flashrl.models import ModelNotBuilt, ModelPathError, load_tokenizer
    from flashrl.models.chat import ChatTemplateError
    from flashrl.procs import paused_gc
    from flashrl.vision.build import ensure_policy as ensure_model

    try:
        with paused_gc():  # transformers' import, before anything is spawned (procs.paused_gc)
            load_tokenizer(ensure_model(cfg, build=build), cfg.model.chat_template, cfg.model.system_prompt)
    except ModelNotBuilt as e:
        typer.echo(f"note: {e}", err=True)
    except (ModelPathError, ChatTemplateError, FileNotFoundError) as e:
        typer.echo(f"config error: {config}: model: {e}", err=True)
        raise typer.Exit(code=2) from None


def _check_reward_model_or_exit(cfg: Config, config: Path) -> None:
    """reward.model names a sequence-classification folder with one label, judge.model a causal LM (exit 2
    naming it and the fix); a built-in one not built yet is noted, not built; the judge's text fits its engines."""
    from flashrl.judge.build import BUILTIN_JUDGE, JudgeModelError, ensure_judge_model
    from flashrl.rewardmodel.build import BUILTIN_RM, RewardModelError, ensure_reward_model

    for key, builtin, ensure in (("reward", BUILTIN_RM, ensure_reward_model), ("judge", BUILTIN_JUDGE, ensure_judge_model)):
        name = getattr(cfg, key).model
        if not name:
            continue
        try:
            ensure(cfg, build=False)
        except (RewardModelError, JudgeModelError) as e:
            if name == builtin:
                typer.echo(f"note: {e}", err=True)
                continue
            typer.echo(f"config error: {config}: {e}", err=True)
            raise typer.Exit(code=2) from None
    from flashrl.judge.checks import check_lengths

    for problem in check_lengths(cfg):  # the judge's text and its engines' max_model_len (flashrl/judge/checks.py)
        typer.echo(f"config error: {config}: {problem}", err=True)
        raise typer.Exit(code=2)


def _check_teachers_or_exit(cfg: Config, config: Path, build: bool = False) -> list[Path]:
    """Each distillation teacher's folder loads as a causal LM and its tokenizer is the student's (exit 2 naming
    both and the fix); a built-in teacher (or student) not built yet is noted, not built (``build`` False:
    validate). Returns the teachers' folders (init-model: built)."""
    from flashrl.distill.build import TeacherModelError, teacher_folder, vocabulary_problem
    from flashrl.models import ModelNotBuilt, Progress
    from flashrl.vision.build import ensure_policy as ensure_model

    folders = []
    for tc in cfg.distill.teachers:
        try:
            folder = teacher_folder(cfg, tc, Progress.for_stderr("init-model") if build else None, build=build)
            student = ensure_model(cfg, build=build)
        except ModelNotBuilt as e:
            typer.echo(f"note: {e}", err=True)
            continue
        except TeacherModelError as e:
            typer.echo(f"config error: {config}: {e}", err=True)
            raise typer.Exit(code=2) from None
        problem = vocabulary_problem(Path(student), Path(folder), tc.name)
        if problem:
            typer.echo(f"config error: {config}: {problem}", err=True)
            raise typer.Exit(code=2)
        folders.append(Path(folder))
    return folders


def _check_lora_or_exit(cfg: Config, config: Path) -> None:
    """[model.lora] fits the model: every target projection takes the rank (exit 2 naming the fix). A model
    folder not built yet is not checked."""
    lora = cfg.model.lora
    if lora.rank == 0:
        return
    import json

    from flashrl.models import BUILTIN_TINY
    from flashrl.wire.lora import model_problems

    model_dir = Path(cfg.model.path).expanduser()
    if cfg.model.path == BUILTIN_TINY:
        from flashrl.models.tiny import TinySpec

        t = TinySpec()
        hf = {"hidden_size": t.hidden, "num_attention_heads": t.heads, "num_key_value_heads": t.kv_heads,
              "intermediate_size": t.intermediate}
        problems = model_problems(lora.rank, lora.target_modules, hf)
    elif (model_dir / "config.json").is_file():  # the model's own projections (meta device: no weights read)
        from flashrl.trainer.lora import fit_problems, spec_of

        try:
            problems = fit_problems(spec_of(lora), model_dir)
        except (ValueError, KeyError, OSError) as e:  # an architecture transformers cannot build: the config's sizes
            typer.echo(f"note: model.lora: {model_dir}'s modules not listed ({type(e).__name__}: {e}); checked the "
                       "ranks against config.json's sizes only", err=True)
            problems = model_problems(lora.rank, lora.target_modules, json.loads((model_dir / "config.json").read_text()))
    else:
        problems = model_problems(lora.rank, lora.target_modules, {})
    if problems:
        typer.echo(f"config error: {config}: model.lora: " + "; ".join(problems), err=True)
        raise typer.Exit(code=2)


@app.command()
def validate(config: ConfigArg, set_: SetOpt = None) -> None:
    """Check CONFIG (types, bounds, unknown keys, environment params) without starting anything."""
    cfg = _load_or_exit(config, set_)
    _check_env_or_exit(cfg, config)
    if cfg.cluster.launcher == "slurm":  # the layout fits [cluster.slurm] (what --dry-run would refuse)
        from flashrl.launch import LaunchError
        from flashrl.launch.slurm_job import plan

        try:
            plan(cfg)
        except LaunchError as e:
            typer.echo(f"config error: {config}: {e}", err=True)
            raise typer.Exit(code=2) from None
    _check_model_or_exit(cfg, config, build=False)
    _check_reward_model_or_exit(cfg, config)
    _check_teachers_or_exit(cfg, config)
    _check_lora_or_exit(cfg, config)
    from flashrl.config import advice

    for note in advice(cfg):
        typer.echo(f"warning: {note}", err=True)
    typer.echo(
        f"ok: {config} (run {cfg.run.name}: {cfg.engine.count} engine(s), {cfg.trainer.ranks} trainer rank(s), "
        f"env {cfg.env.name}, loss {cfg.algorithm.loss}, async_ratio {cfg.scheduler.async_ratio})"
    )


@app.command()
def run(
    config: ConfigArg,
    path: Annotated[Optional[Path], typer.Argument(help="with --resume: a checkpoint (runs/<name>/checkpoints/step-<N>) or a run folder", show_default=False)] = None,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue from the latest checkpoint of runs/<name> (or of PATH: `--resume PATH`)")] = False,
    launcher: Annotated[Optional[str], typer.Option("--launcher", help="where the processes start: local, ray or slurm (= --set cluster.launcher=...)", show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="with --launcher slurm: write and print the sbatch script, submit nothing")] = False,
    supervise: Annotated[bool, typer.Option("--supervise", help="restart the controller from its newest complete checkpoint when it dies (OOM, SIGKILL, a crash); a run dead after its final checkpoint ends as finished; Ctrl-C / SIGTERM stop it all (flashrl/supervise.py, docs/failures.md)")] = False,
    max_restarts: Annotated[int, typer.Option("--max-restarts", min=0, help="with --supervise: controller restarts allowed before giving up")] = 10,
) -> None:
    """Train: start engines and the trainer group, run the controller, show the dashboard."""
    overrides = list(set_ or []) + ([f"cluster.launcher={launcher}"] if launcher is not None else [])
    cfg = _load_or_exit(config, overrides)
    _check_lora_or_exit(cfg, config)
    if supervise:
        if path is not None or dry_run:
            typer.echo("error: --supervise resumes from the latest checkpoint of runs/<name>; it takes no PATH and "
                       "no --dry-run", err=True)
            raise typer.Exit(code=2)
        if cfg.cluster.launcher == "slurm" and not os.environ.get("FLASHRL_SLURM_HEAD"):
            typer.echo("error: --supervise runs beside the controller: with --launcher slurm, start "
                       "`flashrl run CONFIG --supervise` inside the allocation (in your sbatch script)", err=True)
            raise typer.Exit(code=2)
        _check_env_or_exit(cfg, config)
        _check_model_or_exit(cfg, config)
        from flashrl.supervise import main as supervise_main

        raise typer.Exit(code=supervise_main(config, overrides, cfg.run_dir, max_restarts, resume))
    if path is not None and not resume:
        typer.echo(f"error: unexpected argument {path}; to resume from it write `flashrl run {config} --resume {path}`", err=True)
        raise typer.Exit(code=2)
    _check_env_or_exit(cfg, config)
    if cfg.cluster.launcher == "slurm" and not os.environ.get("FLASHRL_SLURM_HEAD"):
        if path is not None:
            typer.echo("error: with --launcher slurm, --resume continues from the latest checkpoint of "
                       f"{cfg.run_dir}; a PATH is not supported", err=True)
            raise typer.Exit(code=2)
        _submit_slurm(cfg, config, dry_run, resume)
        return
    if dry_run:
        typer.echo(f"error: --dry-run renders a SLURM job script; use it with --launcher slurm "
                   f"(cluster.launcher is {cfg.cluster.launcher!r})", err=True)
        raise typer.Exit(code=2)
    _check_model_or_exit(cfg, config)
    from flashrl.launch.driver import main as launch_main

    r = None
    if resume:
        from flashrl.checkpoint import CheckpointError
        from flashrl.resuming import prepare_resume

        try:
            r = prepare_resume(cfg, path)
        except CheckpointError as e:
            typer.echo(f"resume error: {e}", err=True)
            raise typer.Exit(code=2) from None
        for why in r.skipped:
            typer.echo(f"warning: skipped a corrupt checkpoint: {why}", err=True)
    code = launch_main(cfg, resume=r)
    raise typer.Exit(code=code)


def _submit_slurm(cfg: Config, config: Path, dry_run: bool, resume: bool) -> None:
    """cluster.launcher = "slurm" outside an allocation: the sbatch script (printed, in runs/<name>/slurm/), then sbatch."""
    from flashrl.launch import LaunchError, slurm_job

    try:
        script, text = slurm_job.write_job(cfg, resume=resume)
        typer.echo(text)
        if dry_run:
            typer.echo(f"# written to {script} (not submitted: --dry-run)", err=True)
            return
        job = slurm_job.submit(cfg, script)
    except LaunchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"submitted job {job}: {script}; output {script.parent}/{job}.out; cancel with `scancel {job}`", err=True)


@app.command("init-model")
def init_model(config: ConfigArg, set_: SetOpt = None) -> None:
    """Build (once, cached) the model a config names: for builtin:tiny, warm-start it on the task; a missing
    folder, with its [model.build] recipe; a model you provide is only checked."""
    cfg = _load_or_exit(config, set_)
    from flashrl.models import ModelPathError, Progress
    from flashrl.plugins import PluginError
    from flashrl.vision.build import ensure_policy as ensure_model

    # every phase of a build on stderr (a bar on a terminal, a line each otherwise); the path on stdout
    try:
        path = ensure_model(cfg, progress=Progress.for_stderr("init-model"))
    except (ModelPathError, PluginError) as e:  # a model that is the user's to provide, a bad env / WARM_START
        typer.echo(f"config error: {config}: {e}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(str(path))
    if cfg.reward.model:  # the reward model beside it: builtin:rm built (cached), a folder checked
        from flashrl.rewardmodel.build import RewardModelError, ensure_reward_model

        try:
            rm = ensure_reward_model(cfg, progress=Progress.for_stderr("init-model"))
        except RewardModelError as e:
            typer.echo(f"config error: {config}: {e}", err=True)
            raise typer.Exit(code=2) from None
        typer.echo(str(rm))
    if cfg.judge.model:  # the judge beside it: builtin:judge warm-started (cached), a folder checked
        from flashrl.judge.build import JudgeModelError, ensure_judge_model

        try:
            jm = ensure_judge_model(cfg, progress=Progress.for_stderr("init-model"))
        except JudgeModelError as e:
            typer.echo(f"config error: {config}: {e}", err=True)
            raise typer.Exit(code=2) from None
        typer.echo(str(jm))
    for folder in _check_teachers_or_exit(cfg, config, build=True):  # builtin:teacher built (cached), folders checked
        typer.echo(str(folder))


@app.command()
def samples(
    run_dir: Annotated[Path, typer.Argument(help="a run directory, e.g. runs/dataset")],
    step: Annotated[Optional[int], typer.Option("--step", "-n", help="the step to show (default: the last one logged)")] = None,
    kind: Annotated[str, typer.Option(help="train, eval or all")] = "all",
    limit: Annotated[int, typer.Option(help="at most this many samples per kind")] = 8,
) -> None:
    """Show the rollouts and eval generations a run logged to samples.jsonl (log.samples_per_step, log.eval_samples)."""
    from flashrl.samples import SamplesError, show

    try:
        show(run_dir, step=step, kind=kind, limit=limit)
    except SamplesError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="run folder, e.g. runs/tiny")],
    out: Annotated[Path, typer.Option("--out", "-o", help="new folder to write the Hugging Face model to")],
    step: Annotated[Optional[int], typer.Option("--step", help="export checkpoint step N instead of the final policy")] = None,
    adapter: Annotated[bool, typer.Option("--adapter", help="a LoRA run: write the adapter folder (peft format) instead of the merged model")] = False,
) -> None:
    """Write a run's policy (final, or checkpoint --step N) as a Hugging Face folder that transformers and vLLM load
    (a LoRA run: the base with the adapter merged in, or with --adapter the adapter in peft format)."""
    from flashrl.models.export import ExportError, export_run

    try:
        path, what = export_run(run_dir, out, step, adapter=adapter)
    except ExportError as e:
        typer.echo(f"export error: {e}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"exported {what} to {path}")


@app.command()
def doctor(
    gpu: Annotated[bool, typer.Option("--gpu", help="the GPU checks (the default device: cuda)")] = False,
    device: Annotated[str, typer.Option("--device", help="cuda, or cpu: the same checks on the CPU with gloo")] = "cuda",
    timeout: Annotated[float, typer.Option("--timeout", help="deadline in seconds for each multi-process check")] = 600.0,
) -> None:
    """Check what runs on this machine without vLLM: CUDA, weight packing + checksums, trainer steps
    (FSDP2, bf16), DCP save/load, the weight-sync broadcast. One line per check; exit 1 on any FAIL."""
    from flashrl.doctor import run_checks

    if device not in ("cuda", "cpu"):
        typer.echo(f"doctor: --device {device!r}: use cuda or cpu", err=True)
        raise typer.Exit(code=2)
    if gpu and device != "cuda":
        typer.echo("doctor: --gpu runs the checks on cuda; drop --gpu to use --device cpu", err=True)
        raise typer.Exit(code=2)
    checks = run_checks("cuda" if device == "cuda" else "cpu", timeout_s=timeout,
                        on_check=lambda c: typer.echo(c.line()))
    failed = [c.name for c in checks if c.status == "FAIL"]
    typer.echo(f"doctor: {len(checks) - len(failed)} of {len(checks)} checks passed or skipped"
               + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if failed:
        raise typer.Exit(code=1)


@app.command("config-reference")
def config_reference(
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="write it here (e.g. docs/configuration.md) instead of stdout")] = None,
) -> None:
    """Print (or write) the configuration reference: every key with its type, default, bounds and meaning."""
    from flashrl.configref import reference_markdown

    text = reference_markdown()
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}")


@app.command()
def node(
    config: ConfigArg,
    node_id: Annotated[Optional[int], typer.Option("--node", help="this node's number (checked against SLURM_NODEID)", show_default=False)] = None,
    prepare: Annotated[bool, typer.Option("--prepare", help="the job's batch step: build/cache the model, write the keys if missing")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="node 0: the controller continues from the run's latest checkpoint")] = False,
) -> None:
    """One node of a SLURM job (job.sbatch runs it): this node's agent; on node 0 also the controller."""
    cfg = _load_or_exit(config, [])
    from flashrl.launch import slurm_job, slurm_node

    if prepare:
        from flashrl.models import ModelPathError, Progress
        from flashrl.vision.build import ensure_policy as ensure_model

        try:
            model = ensure_model(cfg, progress=Progress.for_stderr("flashrl node --prepare"))
        except ModelPathError as e:
            typer.echo(f"config error: {config}: {e}", err=True)
            raise typer.Exit(code=2) from None
        slurm_job.prepare_keys(cfg)
        typer.echo(f"flashrl: model {model}")
        raise typer.Exit(code=0)
    code = slurm_node.node_main(cfg, config, node_id, resume)
    raise typer.Exit(code=code)


@app.command()
def engine() -> None:
    """Engine process entry point (vLLM behind ZeroMQ), as `python -m flashrl.engine.server`: its EngineSpec
    as JSON in FLASHRL_SPEC."""
    from flashrl.engine import server
    from flashrl.procs import exit_now

    exit_now(server.main())


@app.command()
def trainer() -> None:
    """Trainer rank entry point (FSDP2), as `python -m flashrl.trainer.worker` (torchrun-compatible): its
    TrainerSpec as JSON in FLASHRL_SPEC."""
    from flashrl.procs import exit_now
    from flashrl.trainer import worker

    exit_now(worker.main())


# `flashrl bench COMMAND`: a typer sub-application, one command per mode and per shipped scenario (flashrl/bench/cli.py)
app.add_typer(bench_app, name="bench")


if __name__ == "__main__":
    app()

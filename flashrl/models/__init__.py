"""Model resolution: ``model.path`` -> a local Hugging Face model folder every process can load.

    ensure_model(cfg)
      "builtin:tiny" -> <cache_dir>/tiny-<key>/   (key = hash of spec, warm-start, env, its params but faults,
                                                    its code (flashrl.plugins.code_fingerprint), seed; for a
                                                    demonstrating env also the RL eval's turns and tokens)
      "builtin:moe"  -> <cache_dir>/moe-<key>/    the same, a Qwen3-MoE decoder (flashrl/models/moe.py), "builtin" in the key
          lock <cache_dir>/tiny-<key>.lock (fcntl, so concurrent callers build it once)
            hit : the folder exists -> return it
            miss: build_untrained -> warm_start on the env's train split -> flashrl_warmstart.json
                  in <cache_dir>/.build-*, then os.rename into place (a reader never sees half a model)
      a folder path  -> holds config.json: returned as is
                        missing, and [model.build] names a recipe: built by it (locked, aside, renamed in)
                        missing otherwise: ModelPathError (the model is the user's to provide)

The built-in model is deterministic for a key: it is built on one torch thread with seeded init,
seeded batches and greedy probes, so two machines build the same weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from flashrl.env import Wrapping
from flashrl.models.moe import build_untrained_moe
from flashrl.models.progress import Progress
from flashrl.models.tiny import TinySpec, WarmStart, build_untrained, warm_start
from flashrl.models.tokenizer import load_tokenizer
from flashrl.moe.model import MoeSpec

__all__ = ["BUILTIN_MODELS", "BUILTIN_MOE", "BUILTIN_TINY", "BUILD_RECIPES", "ModelNotBuilt", "ModelPathError", "Progress", "warm_start_of", "TinySpec", "WarmStart", "build_untrained", "ensure_model", "load_tokenizer", "warm_start"]

BUILTIN_TINY = "builtin:tiny"
BUILTIN_MOE = "builtin:moe"  # the same, as a Mixture-of-Experts (flashrl/moe/model.py): same tokenizer and warm-start
BUILTIN_MODELS = (BUILTIN_TINY, BUILTIN_MOE)
WARMSTART_FILE = "flashrl_warmstart.json"
# Bump when the build recipe changes in a way the key does not capture (invalidates old caches).
_RECIPE_VERSION = 1

log = logging.getLogger("flashrl.models")


class ModelPathError(FileNotFoundError):
    """model.path does not name a usable model folder; the message says how to fix it."""


class ModelNotBuilt(ModelPathError):
    """model.path is missing and [model.build] names the recipe that builds it, but the caller asked not to
    build (``flashrl validate``); ``flashrl init-model`` (or ``flashrl run``) builds it."""


def _task_params(cfg) -> dict:
    """``env.params`` without ``faults``: the model learns the task, not its delays or injected faults.

    A wrapper's inner environment (``env.name = "remote"``: ``[env.params.params.faults]``) loses its
    ``faults`` too: they act in the workers at run time, and in the warm-start (which plays the inner
    suite in this process) an injected crash would end the build, and a changed rate would rebuild it.
    """
    params = {k: v for k, v in cfg.env.params.items() if k != "faults"}
    inner = params.get("params")
    if cfg.env.name == "remote" and isinstance(inner, dict) and "faults" in inner:
        params["params"] = {k: v for k, v in inner.items() if k != "faults"}
    return params


def warm_start_of(name: str, params: dict) -> WarmStart:
    """The warm-start of env ``name``: WarmStart's defaults with its suite's ``WARM_START`` (the wrapped
    suite's under remote). A key WarmStart does not have, or a value of the wrong type, is a PluginError
    naming it and the keys accepted (``flashrl validate`` runs this: flashrl/envcheck.py)."""
    from flashrl.config_errors import describe
    from flashrl.plugins import PluginError, task_env, warm_start_overrides

    overrides = warm_start_overrides(name, params)
    try:
        return msgspec.convert(msgspec.to_builtins(WarmStart()) | overrides, WarmStart, strict=True)
    except msgspec.ValidationError as e:
        cls, _, key = task_env(name, params)
        where = f"{cls.__module__}.{cls.__qualname__}.WARM_START"
        path, what = describe(str(e), WarmStart, prefix=where, owner="the built-in model's warm-start")
        raise PluginError(f"{key}: {path}: {what.replace(f'[{where}]', 'WARM_START')} "
                          "(docs/models.md: the warm-start and its knobs)") from None


def _eval_play(cfg) -> tuple[int, int] | None:
    """(turns, tokens per turn) the RL eval plays an episode with, for an environment that demonstrates
    (its warm-start report plays its held-out episodes the same way); None for the others."""
    from flashrl.plugins import task_env

    cls, _, _ = task_env(cfg.env.name, _task_params(cfg))
    if not callable(getattr(cls, "demonstration", None)):
        return None
    return cfg.rollout.max_turns, cfg.rollout.max_new_tokens


def _cache_key(cfg, spec, warm: WarmStart) -> str:
    from flashrl.plugins import code_fingerprint

    blob = {
        "recipe": _RECIPE_VERSION,
        "spec": msgspec.to_builtins(spec),
        "warm": msgspec.to_builtins(warm),
        "env": cfg.env.name,
        "params": _task_params(cfg),
        "code": code_fingerprint(cfg.env.name, _task_params(cfg)),  # an edited demonstration() rebuilds
        "eval_size": cfg.env.eval_size,
        "seed": cfg.run.seed,
    }
    if cfg.model.path != BUILTIN_TINY:  # builtin:tiny's keys stay what they were
        blob["builtin"] = cfg.model.path
    play = _eval_play(cfg)
    if play is not None:  # only the report's held-out play uses them; a single-turn env ignores them
        blob["eval_play"] = list(play)
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # determinism (same reduction order everywhere) and a fair share of the CPU
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _is_built(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / WARMSTART_FILE).is_file()


def ensure_model(cfg, spec: TinySpec | MoeSpec | None = None, warm: WarmStart | None = None,
                 progress: Progress | None = None, build: bool = True) -> Path:
    """Return the model folder for ``cfg.model.path``, building and caching ``builtin:tiny`` (``builtin:moe``) once, and
    building a missing folder that ``[model.build]`` has a recipe for.

    ``spec`` / ``warm`` override the built-in model's shape and warm-start (defaults: ``TinySpec()`` or
    ``[moe.builtin]``, ``WarmStart()``); they are part of the cache key. ``progress`` (``flashrl init-model``): every
    phase of a build shown as it runs (progress.py); None: only the log. ``build`` False: a missing
    folder with a recipe raises ModelNotBuilt instead of being built (``flashrl validate``).
    """
    if cfg.model.path not in BUILTIN_MODELS:
        return _model_folder(cfg, progress or Progress.off(), build)

    moe = cfg.model.path == BUILTIN_MOE
    spec = spec or (cfg.moe.builtin if moe else TinySpec())  # [moe.builtin] (flashrl/moe/config.py)
    if warm is None:  # the defaults, with the environment's own overrides (flashrl.env.Demonstrating)
        warm = warm_start_of(cfg.env.name, _task_params(cfg))
    cache = Path(cfg.model.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    key = _cache_key(cfg, spec, warm)
    final = cache / f"{'moe' if moe else 'tiny'}-{key}"
    if _is_built(final):
        return final
    if not build:
        raise ModelNotBuilt(f"{BUILTIN_TINY} for this config is not built yet ({final}); `flashrl init-model CONFIG` "
                            "(or `flashrl run`) builds it")
    shown = progress or Progress.off()

    def fill(tmp: Path) -> None:
        from flashrl.plugins import make_suite

        with shown.phase(f"loading the tasks of env {cfg.env.name}", unit="tasks") as phase:
            suite = make_suite(cfg.env.name, _task_params(cfg), seed=cfg.run.seed, eval_size=cfg.env.eval_size)
            if isinstance(suite, Wrapping):  # a wrapper (remote) warm-starts on what it wraps
                suite = suite.task_suite
            phase.advance(len(suite.train_tasks()), held_out=len(suite.eval_tasks()))
        log.info("building %s (key %s) for env %s: spec %s", cfg.model.path, key, cfg.env.name, spec)
        with _one_torch_thread():
            with shown.phase("building the untrained model"):
                if isinstance(spec, MoeSpec):
                    build_untrained_moe(tmp, seed=cfg.run.seed, spec=spec)
                else:
                    build_untrained(tmp, seed=cfg.run.seed, spec=spec)
            report = warm_start(tmp, suite.train_tasks(), suite.eval_tasks(), warm, seed=cfg.run.seed,
                                log=log.info, suite=suite, progress=shown, eval_play=_eval_play(cfg))
        report |= {"key": key, "env": cfg.env.name, "params": _task_params(cfg), "seed": cfg.run.seed,
                   "spec": msgspec.to_builtins(spec), "warm": msgspec.to_builtins(warm)}
        (tmp / WARMSTART_FILE).write_text(json.dumps(report, indent=2, default=str))
        log.info("built %s: held-out greedy accuracy %.3f in %.1f s", final, report["eval_accuracy"], report["seconds"])

    return build_folder(final, _is_built, fill)


def build_folder(final: Path, built: Callable[[Path], bool], fill: Callable[[Path], None], *,
                 prefix: str = ".build-") -> Path:
    """Build the folder ``final`` once, whatever the number of processes asking: under the file lock
    ``<final>.lock`` beside it (a process that waited for it finds ``final`` ``built``), ``fill(tmp)``
    writes a temporary folder beside it, renamed into place once complete, so that no reader sees half a
    folder. A ``final`` that is there but not ``built`` (a killed older recipe's) is replaced."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f"{final.name}.lock"):
        if built(final):  # another process built it while we waited for the lock
            return final
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
        try:
            fill(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# --------------------------------------------------------------------------- model folders flashrl builds
def _build_chat(cfg, out: Path, progress: Progress) -> None:
    from flashrl.models import chat_model

    b = cfg.model.build
    with progress.phase(f"building the {b.size} chat model ({b.arch}, {b.template} template, seed {b.seed}; "
                        f"flashrl/models/chat_model.py)"):
        chat_model.build_chat_model(out, arch=b.arch, size=b.size, seed=b.seed, template=b.template)


# [model.build] recipe -> its builder(cfg, folder to write, progress)
BUILD_RECIPES = {"chat": _build_chat}


def _model_folder(cfg, progress: Progress, build: bool) -> Path:
    """``model.path`` as a folder: as it is when it holds config.json, else built by its [model.build] recipe."""
    p = Path(cfg.model.path).expanduser()
    if (p / "config.json").is_file():
        return p
    recipe = cfg.model.build.recipe
    if recipe == "none":
        if p.exists():
            raise ModelPathError(f"model.path: {str(p)!r} holds no config.json; set model.path to a local Hugging "
                                 f"Face model folder (with config.json, weights and tokenizer files) or to {BUILTIN_TINY!r}")
        raise ModelPathError(
            f"model.path: {str(p)!r} does not exist. flashrl builds only {BUILTIN_TINY!r} and the folders a "
            f"[model.build] recipe names; this model is yours to provide: download it (e.g. `hf download "
            f"<org>/<model> --local-dir {p}`) or copy it there, set model.path to a local Hugging Face model "
            f"folder (config.json, weights and tokenizer files), or use {BUILTIN_TINY!r}")
    if p.exists() and any(p.iterdir()):
        raise ModelPathError(f"model.path: {str(p)!r} holds no config.json but is not empty, so the [model.build] "
                             f"recipe {recipe!r} will not build over it; remove it (or point model.path elsewhere) "
                             "and run `flashrl init-model CONFIG`")
    if not build:
        raise ModelNotBuilt(f"model.path: {str(p)!r} is not built yet; `flashrl init-model CONFIG` (or `flashrl "
                            f"run`) builds it with the [model.build] recipe {recipe!r}")
    p.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(p.parent / f".{p.name}.lock"):
        if (p / "config.json").is_file():  # another process built it while we waited for the lock
            return p
        for stale in p.parent.glob(f".{p.name}.build-*"):  # a killed build's (we hold the lock: nobody writes it)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}.build-", dir=p.parent))
        try:
            log.info("building %s with the [model.build] recipe %r", p, recipe)
            BUILD_RECIPES[recipe](cfg, tmp, progress)
            if p.exists():  # the empty folder checked above
                p.rmdir()
            os.rename(tmp, p)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return p

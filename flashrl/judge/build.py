"""The built-in judge (``judge.model = "builtin:judge"``): the built-in causal LM warm-started to give verdicts.

    ensure_judge_model(cfg)
      "builtin:judge" -> <cache_dir>/judge-<key>/   key = hash of the recipe, judge.template, the env, its params
                                                     but faults, its code fingerprint and the seed
        miss: judge tasks = judge.template filled with a train prompt and an answer (the row's own, or a
              perturbation of it: flashrl.rewardmodel.build.perturbations), the verdict pass or fail the
              environment's verifier gives, written "1" or "0" (so the warm-start's
              integer probe reads them) -> flashrl.models.tiny: build_untrained + warm_start (supervised,
              prompt -> verdict + EOS; greedy held-out verdict accuracy in flashrl_warmstart.json)
      a folder        -> it must hold config.json (a causal LM vLLM can serve); else JudgeModelError

The judge sees what the policy wrote; the verifier labelled what it learned from. Its weights never change
in a run: no weight sync ever reaches a judge engine (flashrl/judge/engines.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from flashrl.env import EnvSuite, Task, Wrapping
from flashrl.models.progress import Progress

__all__ = ["BUILTIN_JUDGE", "JudgeModelError", "ensure_judge_model", "judge_tasks"]

BUILTIN_JUDGE = "builtin:judge"
_RECIPE_VERSION = 2
_TRAIN = 16_000  # judge tasks to warm-start on (half right answers, half wrong)


class JudgeModelError(FileNotFoundError):
    """judge.model does not name a usable folder; the message says which and how to fix it."""


def check_folder(path: str | Path, key: str = "judge.model") -> Path:
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        what = "does not exist" if not p.exists() else "holds no config.json"
        raise JudgeModelError(f"{key}: {str(p)!r} {what}; set {key} to a local Hugging Face causal-LM folder "
                              f"(config.json, weights, tokenizer files) or to {BUILTIN_JUDGE!r} (built by "
                              "`flashrl init-model CONFIG`)")
    conf = json.loads((p / "config.json").read_text())
    archs = [str(a) for a in conf.get("architectures") or []]
    if archs and not any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in archs):
        raise JudgeModelError(f"{key}: {str(p)!r} is a {', '.join(archs)}; a judge writes its verdict, so it must be a "
                              "causal LM (*ForCausalLM); a sequence-classification model goes in reward.model")
    return p


def _task_params(cfg: Any) -> dict[str, Any]:
    return {k: v for k, v in cfg.env.params.items() if k != "faults"}


def _folder(cfg: Any) -> Path:
    from flashrl.plugins import code_fingerprint

    blob = {"recipe": _RECIPE_VERSION, "template": cfg.judge.template, "env": cfg.env.name,
            "params": _task_params(cfg), "code": code_fingerprint(cfg.env.name, _task_params(cfg)),
            "eval_size": cfg.env.eval_size, "seed": cfg.run.seed}
    key = hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cfg.model.cache_dir).expanduser() / f"judge-{key}"


def judge_tasks(tasks: list[Task], n: int, template: str, suite: EnvSuite, rng: random.Random) -> list[Task]:
    """``n`` judge tasks: the template filled with a prompt and an answer, answered "P" (the verifier accepts
    it) or "F" (it does not); half of them from the row's own answer, half from a perturbation."""
    from flashrl.rewardmodel.build import _Labeller, perturbations

    lab = _Labeller(suite)
    out: list[Task] = []
    try:
        while len(out) < n:
            t = rng.choice(tasks)
            ans = t.answer if len(out) % 2 == 0 else rng.choice(perturbations(t.answer, t.prompt, rng))
            ok = lab.correct(t, ans)
            out.append(Task(id=f"judge-{len(out)}", prompt=template.format(prompt=t.prompt, response=ans.strip()),
                            answer="1" if ok else "0"))
    finally:
        lab.close()
    return out


def ensure_judge_model(cfg: Any, progress: Progress | None = None, build: bool = True) -> Path:
    """The judge's folder, building and caching ``builtin:judge`` once."""
    if cfg.judge.model != BUILTIN_JUDGE:
        return check_folder(cfg.judge.model)
    from flashrl.models import WARMSTART_FILE, _file_lock, _one_torch_thread
    from flashrl.models.tiny import WarmStart, build_untrained, warm_start

    final = _folder(cfg)
    if (final / WARMSTART_FILE).is_file():
        return final
    if not build:
        raise JudgeModelError(f"judge.model: {BUILTIN_JUDGE!r} is not built yet for this env, template and seed; "
                              "`flashrl init-model CONFIG` (or `flashrl run`) builds it")
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f"{final.name}.lock"):
        if (final / WARMSTART_FILE).is_file():
            return final
        from flashrl.plugins import make_suite

        progress = progress or Progress.off()
        suite = make_suite(cfg.env.name, _task_params(cfg), seed=cfg.run.seed, eval_size=cfg.env.eval_size)
        if isinstance(suite, Wrapping):
            suite = suite.task_suite
        rng = random.Random(cfg.run.seed)
        with progress.phase("labelling the judge's answers with the verifier"):
            train = judge_tasks(list(suite.train_tasks()), _TRAIN, cfg.judge.template, suite, rng)
            held = judge_tasks(list(suite.eval_tasks()), 512, cfg.judge.template, suite, random.Random(cfg.run.seed + 1))
        ws = WarmStart(max_steps=4000, target_accuracy=0.97, min_steps=0, teacher_carry_slip=0.0, check_every=250)
        tmp = Path(tempfile.mkdtemp(prefix=".build-judge-", dir=final.parent))
        try:
            with _one_torch_thread():
                with progress.phase("building the untrained judge"):
                    build_untrained(tmp, seed=cfg.run.seed + 1000)  # not the policy's init
                report = warm_start(tmp, train, held, ws, seed=cfg.run.seed, progress=progress)
            report |= {"judge": True, "template": cfg.judge.template, "env": cfg.env.name,
                       "params": _task_params(cfg), "seed": cfg.run.seed, "warm": msgspec.to_builtins(ws)}
            (tmp / WARMSTART_FILE).write_text(json.dumps(report, indent=2, default=str))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final

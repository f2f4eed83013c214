"""The built-in judge (``judge.model = "builtin:judge"``): the built-in causal LM warm-started to solve, then judge.

    ensure_judge_model(cfg)
      "builtin:judge" -> <cache_dir>/judge-<key>/   key = hash of the recipe, judge.template, the env, its params
                                                     but faults, its code fingerprint and the seed
        miss: judge tasks = judge.template filled with a train prompt and an answer (the row's own, or a
              perturbation of it: flashrl.rewardmodel.build.perturbations); the judge's target is its own
              solution, a space, the answer it judges copied, a space, and the verdict the environment's
              verifier gives: "46 46 1" (pass) or "46 47 0" (fail) -> flashrl.models.tiny: build_untrained, then supervised training on the targets (SFT,
              the warm-start's batches and loss) until the held-out verdict accuracy reaches 97% or max steps
              (flashrl_warmstart.json: eval_verdict_accuracy, pass rates on right and wrong answers)
      a folder        -> it must hold config.json (a causal LM vLLM can serve); else JudgeModelError

Why solve first: trained to write the verdict alone ("12+34=47?" -> "0"), the built-in model learned only
the answer's form: it passed 99% of wrong sums (a forgotten carry, +-1, +-10) and a policy trained against
it lost accuracy while its judged reward rose to 1 (bench/results/judge/lenient). Writing its own sum first
turns the verdict into a comparison of two numbers in its context (a generative judge that reasons before
it rules, at the scale of a 2-layer model). Why it then copies the answer: with only its sum before the
verdict ("46 0"), the comparison spans the prompt, and the model learned the tens digit only: it passed 97%
of answers off by one (bench/results/judge/solve-then-judge). Copied beside its sum, each digit of the answer
sits a fixed distance from the digit of the sum it must equal, which a 2-layer model compares. The judge sees what the
policy wrote; the verifier labelled what it learned from. Its weights never change in a run: no weight sync
ever reaches a judge engine (flashrl/judge/engines.py).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from flashrl.env import EnvSuite, Task, Wrapping
from flashrl.models.progress import Progress

__all__ = ["BUILTIN_JUDGE", "JudgeModelError", "ensure_judge_model", "judge_tasks"]

BUILTIN_JUDGE = "builtin:judge"
_RECIPE_VERSION = 4
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
    """``n`` judge tasks: the template filled with a prompt and an answer, the target the judge's own solution
    (the row's answer), a space, the answer judged, a space and the verdict, "1" where the verifier accepts the
    answer, "0" where it does not; half of them from the row's own answer, half from a perturbation of it."""
    from flashrl.rewardmodel.build import _Labeller, perturbations

    lab = _Labeller(suite)
    out: list[Task] = []
    try:
        while len(out) < n:
            t = rng.choice(tasks)
            ans = t.answer if len(out) % 2 == 0 else rng.choice(perturbations(t.answer, t.prompt, rng))
            ok = lab.correct(t, ans)
            judged = ans.strip()
            out.append(Task(id=f"judge-{len(out)}", prompt=template.format(prompt=t.prompt, response=judged),
                            answer=f"{t.answer} {judged} {1 if ok else 0}"))
    finally:
        lab.close()
    return out


def _verdicts(model: Any, tok: Any, tasks: list[Task], max_new: int) -> list[str]:
    from flashrl.models.tiny import generate

    out: list[str] = []
    for k in range(0, len(tasks), 256):
        chunk = tasks[k:k + 256]
        gen = generate(model, [tok.encode(t.prompt) for t in chunk], max_new, tok.eos_token_id, tok.pad_token_id)
        out += [tok.decode(g, skip_special_tokens=True) for g in gen]
    return out


def train_judge(out: Path, train: list[Task], held: list[Task], seed: int, progress: Progress,
                max_steps: int = 4000, batch: int = 64, lr: float = 1e-3, check_every: int = 250,
                target: float = 0.97) -> dict[str, Any]:
    """Supervised training of the judge in ``out`` (prompt -> solution, answer copied, verdict, EOS); its report."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashrl.models.tiny import answer_tokens, batch_loss, sft_batch

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    max_new = answer_tokens(train + held)

    def accuracy() -> dict[str, float]:
        model.eval()
        got = _verdicts(model, tok, held, max_new)
        model.train()
        right = [g.strip()[-1:] == t.answer[-1] for g, t in zip(got, held)]
        ok = [t.answer.endswith("1") for t in held]
        return {"verdict_accuracy": sum(right) / len(held),
                "pass_on_right": sum(g.strip().endswith("1") for g, o in zip(got, ok) if o) / max(1, sum(ok)),
                "pass_on_wrong": sum(g.strip().endswith("1") for g, o in zip(got, ok) if not o) / max(1, len(ok) - sum(ok))}

    acc: dict[str, float] = {}
    step = 0
    with progress.phase("training the judge (its solution, the answer, the verdict)", total=max_steps, unit="steps") as phase:
        model.train()
        for step in range(1, max_steps + 1):
            loss = batch_loss(model, sft_batch(tok, rng.sample(train, batch)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            phase.advance(1, loss=float(loss.detach()))
            if step % check_every == 0:
                acc = accuracy()
                phase.note(**acc)
                if acc["verdict_accuracy"] >= target:
                    phase.finish(step)
                    break
    acc = accuracy()
    model.save_pretrained(str(out), safe_serialization=True)
    return {"eval_" + k: v for k, v in acc.items()} | {"steps": step, "seconds": round(time.perf_counter() - t0, 2)}


def ensure_judge_model(cfg: Any, progress: Progress | None = None, build: bool = True) -> Path:
    """The judge's folder, building and caching ``builtin:judge`` once."""
    if cfg.judge.model != BUILTIN_JUDGE:
        return check_folder(cfg.judge.model)
    from flashrl.models import WARMSTART_FILE, _one_torch_thread, build_folder
    from flashrl.models.tiny import build_untrained

    final = _folder(cfg)
    if (final / WARMSTART_FILE).is_file():
        return final
    if not build:
        raise JudgeModelError(f"judge.model: {BUILTIN_JUDGE!r} is not built yet for this env, template and seed; "
                              "`flashrl init-model CONFIG` (or `flashrl run`) builds it")
    shown = progress or Progress.off()

    def fill(tmp: Path) -> None:
        from flashrl.plugins import make_suite

        suite = make_suite(cfg.env.name, _task_params(cfg), seed=cfg.run.seed, eval_size=cfg.env.eval_size)
        if isinstance(suite, Wrapping):
            suite = suite.task_suite
        rng = random.Random(cfg.run.seed)
        with shown.phase("labelling the judge's answers with the verifier"):
            train = judge_tasks(list(suite.train_tasks()), _TRAIN, cfg.judge.template, suite, rng)
            held = judge_tasks(list(suite.eval_tasks()), 512, cfg.judge.template, suite, random.Random(cfg.run.seed + 1))
        with _one_torch_thread():
            with shown.phase("building the untrained judge"):
                build_untrained(tmp, seed=cfg.run.seed + 1000)  # not the policy's init
            report = train_judge(tmp, train, held, seed=cfg.run.seed, progress=shown)
        report |= {"judge": True, "template": cfg.judge.template, "env": cfg.env.name,
                   "params": _task_params(cfg), "seed": cfg.run.seed}
        (tmp / WARMSTART_FILE).write_text(json.dumps(report, indent=2, default=str))

    return build_folder(final, lambda f: (f / WARMSTART_FILE).is_file(), fill, prefix=".build-judge-")

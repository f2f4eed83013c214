"""The built-in reward model (``reward.model = "builtin:rm"``): a Bradley-Terry head trained on preference
pairs that the environment's own verifier labels, built locally and cached like the built-in policy.

    ensure_reward_model(cfg)                      (flashrl init-model, flashrl run, validate with build=False)
      "builtin:rm" -> <cache_dir>/rm-<key>/      key = hash of RmSpec, the env, its params but faults, its
                                                  code fingerprint and the seed
        hit : the folder holds config.json and flashrl_rm.json -> returned
        miss: a random-init LlamaForSequenceClassification (one label) + the char tokenizer ->
              train_rm: pairs (prompt + a verified-correct answer, prompt + a perturbed answer the verifier
              rejects), loss -log sigmoid(s+ - s-) + anchor x BCE(s+, 1) + anchor x BCE(s-, 0) ->
              held-out pair accuracy -> flashrl_rm.json, renamed into place (a reader never sees half a model)
      a folder   -> checked (check_folder): config.json with a *ForSequenceClassification architecture
                    and num_labels = 1; else RewardModelError naming the folder and the fix

Why pairs from the verifier: the issue asks for a reward model the policy can be trained against while the
verifier stays the held-out truth. The answers the pairs are made of come from perturbing the row's
answer (digits changed, dropped, doubled; +-1, +-10; the forgotten units carry of the warm-start's teacher),
and every one is labelled by the environment's verifier (env.step), so the model learns the task's
notion of correct, not the perturbations'. The pointwise anchor (small BCE on each side) pins the scale so
that sigmoid(score) reads as a probability of "correct": the logged gap (sigmoid(score) - verifier) is then
meaningful. What it cannot do: tasks whose answers are not short strings one can perturb (multi-turn,
code) get no useful pairs; ``builtin:rm`` is for single-turn tasks with short answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from flashrl.env import EnvSuite, Task, Wrapping
from flashrl.models.progress import Progress

__all__ = ["BUILTIN_RM", "RM_REPORT", "RewardModelError", "RmSpec", "check_folder", "ensure_reward_model",
           "perturbations", "train_rm"]

log = logging.getLogger("flashrl.rewardmodel")

BUILTIN_RM = "builtin:rm"
RM_REPORT = "flashrl_rm.json"
_RECIPE_VERSION = 3


class RewardModelError(FileNotFoundError):
    """reward.model does not name a usable reward-model folder; the message says which and how to fix it."""


class RmSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The built-in reward model's shape and training (part of its cache key)."""

    layers: Annotated[int, Meta(ge=1, le=64)] = 4
    hidden: Annotated[int, Meta(ge=32, le=8192)] = 128
    heads: Annotated[int, Meta(ge=1, le=128)] = 4
    intermediate: Annotated[int, Meta(ge=16, le=65536)] = 512
    steps: Annotated[int, Meta(ge=1)] = 1200  # held-out pair accuracy ~0.90 by 1000 steps, flat to 3000 (seed 0)
    batch: Annotated[int, Meta(ge=1)] = 128  # pairs per step
    lr: Annotated[float, Meta(gt=0)] = 1e-3
    anchor: Annotated[float, Meta(ge=0)] = 0.25  # weight of the pointwise BCE terms
    # weight of a next-token loss on the correct answer's characters (the body's hidden states, read by the
    # embeddings as an LM head; only the score is served): it makes the body compute the answer, which the
    # pairs alone did not teach it (bench/results/rm: the units digit)
    lm_weight: Annotated[float, Meta(ge=0)] = 1.0
    check_every: Annotated[int, Meta(ge=1)] = 250
    target_pair_accuracy: Annotated[float, Meta(ge=0, le=1)] = 0.99  # stop early past it (held-out pairs)
    eval_pairs: Annotated[int, Meta(ge=1)] = 1024


# --------------------------------------------------------------------------- folders
def check_folder(path: str | Path, key: str = "reward.model") -> Path:
    """``path`` as a reward-model folder, or RewardModelError naming what is wrong and how to fix it."""
    p = Path(path).expanduser()
    if not p.exists():
        raise RewardModelError(f"{key}: {str(p)!r} does not exist; set {key} to a local Hugging Face sequence-"
                               f"classification folder, or to {BUILTIN_RM!r} (built by `flashrl init-model CONFIG`)")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise RewardModelError(f"{key}: {str(p)!r} holds no config.json; a reward model is a Hugging Face folder "
                               "(config.json, weights, tokenizer files) saved by a *ForSequenceClassification model")
    try:
        conf = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise RewardModelError(f"{key}: {cfg_file} is not valid JSON ({e})") from None
    archs = conf.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise RewardModelError(f"{key}: {str(p)!r} is a {', '.join(map(str, archs)) or 'model without architectures'}, "
                               "not a sequence-classification model; a reward model needs a *ForSequenceClassification "
                               "head with one label (e.g. saved from AutoModelForSequenceClassification(num_labels=1))")
    labels = conf.get("num_labels", len(conf.get("id2label") or {}) or 2)
    if labels != 1:
        raise RewardModelError(f"{key}: {str(p)!r} has {labels} labels; a scalar reward model has one "
                               "(num_labels = 1: its logit is the score)")
    return p


def _task_params(cfg: Any) -> dict[str, Any]:
    return {k: v for k, v in cfg.env.params.items() if k != "faults"}


def _cache_key(cfg: Any, spec: RmSpec) -> str:
    from flashrl.plugins import code_fingerprint

    blob = {
        "recipe": _RECIPE_VERSION, "spec": msgspec.to_builtins(spec), "env": cfg.env.name,
        "params": _task_params(cfg), "code": code_fingerprint(cfg.env.name, _task_params(cfg)),
        "eval_size": cfg.env.eval_size, "seed": cfg.run.seed,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def builtin_folder(cfg: Any, spec: RmSpec | None = None) -> Path:
    return Path(cfg.model.cache_dir).expanduser() / f"rm-{_cache_key(cfg, spec or RmSpec())}"


def ensure_reward_model(cfg: Any, spec: RmSpec | None = None, progress: Progress | None = None,
                        build: bool = True) -> Path:
    """The folder of ``cfg.reward.model``, building and caching ``builtin:rm`` once (``build`` False: a
    missing built-in model raises RewardModelError saying `flashrl init-model` builds it)."""
    if cfg.reward.model != BUILTIN_RM:
        return check_folder(cfg.reward.model)
    from flashrl.models import build_folder

    spec = spec or RmSpec()
    final = builtin_folder(cfg, spec)
    if (final / RM_REPORT).is_file():
        return final
    if not build:
        raise RewardModelError(f"reward.model: {BUILTIN_RM!r} is not built yet for this env and seed; "
                               "`flashrl init-model CONFIG` (or `flashrl run`) builds it")

    def fill(tmp: Path) -> None:
        from flashrl.plugins import make_suite

        suite = make_suite(cfg.env.name, _task_params(cfg), seed=cfg.run.seed, eval_size=cfg.env.eval_size)
        if isinstance(suite, Wrapping):
            suite = suite.task_suite
        report = train_rm(tmp, suite, spec, seed=cfg.run.seed, progress=progress or Progress.off())
        report |= {"env": cfg.env.name, "params": _task_params(cfg), "seed": cfg.run.seed,
                   "spec": msgspec.to_builtins(spec)}
        (tmp / RM_REPORT).write_text(json.dumps(report, indent=2, default=str))
        log.info("built %s: held-out pair accuracy %.3f", final, report["eval_pair_accuracy"])

    return build_folder(final, lambda f: (f / RM_REPORT).is_file(), fill, prefix=".build-rm-")


# --------------------------------------------------------------------------- pairs
def perturbations(answer: str, prompt: str, rng: random.Random) -> list[str]:
    """Candidate wrong answers near ``answer`` (the verifier decides which are wrong)."""
    from flashrl.models.tiny import carry_slip_answer

    out: list[str] = []
    digits = "0123456789"
    if answer:
        i = rng.randrange(len(answer))
        out.append(answer[:i] + rng.choice(digits) + answer[i + 1:])  # one digit changed
        out.append(answer[:i] + answer[i + 1:])  # one dropped
        out.append(answer[:i] + rng.choice(digits + " ") + answer[i:])  # one inserted
        out.append(answer + " " + answer)  # said twice
        out.append(answer[::-1])
    try:
        n = int(answer)
        out += [str(n + d) for d in (1, -1, 10, -10, rng.choice((-100, 100, 2, -2, 11, -11, 9, -9)))]
        # the last digit wrong, three times over: a first model trained without them passed 87% of answers off
        # by one, and the policy trained against it learned exactly those (bench/results/rm/v1-hacked)
        last = int(answer[-1]) if answer[-1].isdigit() else 0
        out += [answer[:-1] + str((last + rng.randint(1, 9)) % 10) for _ in range(3)]
    except ValueError:
        pass
    slip = carry_slip_answer(prompt)
    if slip is not None:
        out += [slip, slip]  # the teacher's slip: the policy's most common mistake, weighed twice
    out.append("".join(rng.choice(digits) for _ in range(rng.randint(1, 4))))
    out.append(rng.choice(("", " ", "=", "+", "a", "-")))
    return out


class _Labeller:
    """The suite's verifier on (task, answer): one env per call (cheap for the built-ins)."""

    def __init__(self, suite: EnvSuite) -> None:
        self.suite = suite
        self.loop = asyncio.new_event_loop()

    def correct(self, task: Task, answer: str) -> bool:
        async def one() -> bool:
            env = self.suite.make_env()
            try:
                await env.reset(task)
                res = await env.step(answer)
            finally:
                await env.close()
            ok = res.info.get("correct")
            return bool(ok) if isinstance(ok, bool) else res.reward >= 1.0
        return self.loop.run_until_complete(one())

    def close(self) -> None:
        self.loop.close()


def _pairs(tasks: list[Task], n: int, lab: _Labeller, rng: random.Random) -> list[tuple[str, str, str]]:
    """``n`` (prompt, correct answer, wrong answer) triples, each side checked by the verifier."""
    out: list[tuple[str, str, str]] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n:
            raise RuntimeError("builtin:rm: the environment's verifier accepts neither the rows' answers nor rejects "
                               "their perturbations; this task has no pairs the built-in reward model can learn from")
        t = rng.choice(tasks)
        if not lab.correct(t, t.answer):
            continue
        cands = perturbations(t.answer, t.prompt, rng)
        wrong = rng.choice(cands)
        if lab.correct(t, wrong):
            continue
        out.append((t.prompt, t.answer, wrong))
    return out


def rm_text(prompt: str, response: str) -> str:
    """What the reward model reads: the prompt and the response up to its end-of-sequence mark, stripped."""
    from flashrl.env import cut_at_eos

    return prompt + cut_at_eos(response).strip()


# --------------------------------------------------------------------------- training
def build_untrained_rm(out: Path, spec: RmSpec, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from flashrl.models.tokenizer import BOS, EOS, PAD, build_char_tokenizer

    tok = build_char_tokenizer()
    config: Any = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        max_position_embeddings=256, rope_theta=10000.0, num_labels=1,
        pad_token_id=tok.convert_tokens_to_ids(PAD), bos_token_id=tok.convert_tokens_to_ids(BOS),
        eos_token_id=tok.convert_tokens_to_ids(EOS), torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model: Any = LlamaForSequenceClassification(config)
    model = model.to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def text_ids(tok: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids (no special tokens; an empty text is one pad token)."""
    return [tok.encode(t, add_special_tokens=False) or [tok.pad_token_id] for t in texts]


def encode_batch(tok: Any, texts: list[str]) -> tuple[Any, Any]:
    """Right-padded input ids and attention mask (the sequence-classification head reads the last real token)."""
    return pad_batch(tok, text_ids(tok, texts))


def pad_batch(tok: Any, ids: list[list[int]]) -> tuple[Any, Any]:
    """``ids`` right-padded, and their attention mask."""
    import torch

    width = max(len(x) for x in ids)
    inp = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        inp[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
    return inp, mask


def scores(model: Any, tok: Any, texts: list[str]) -> list[float]:
    """The model's scalar score of each text (its one logit)."""
    import torch

    if not texts:
        return []
    inp, mask = encode_batch(tok, texts)
    with torch.no_grad():
        logits = model(input_ids=inp, attention_mask=mask).logits
    return [float(x) for x in logits[:, 0].tolist()]


def _answer_lm_loss(model: Any, tok: Any, hidden: Any, inp: Any, mask: Any, batch: list[tuple[str, str, str]]) -> Any:
    """Next-token cross-entropy of the correct answers' characters, predicted from the body's last hidden
    states through the tied embeddings (training only: the served model is the classifier as saved)."""
    import torch
    import torch.nn.functional as F

    logits = hidden[:, :-1] @ model.get_input_embeddings().weight.T
    target = inp[:, 1:].clone()
    keep = mask[:, 1:].bool()
    for i, (p, _, _) in enumerate(batch):  # only the answer's characters: the prompt's operands are random
        keep[i, : max(0, len(tok.encode(p, add_special_tokens=False)) - 1)] = False
    target[~keep] = -100
    if not bool(keep.any()):
        return torch.zeros((), dtype=hidden.dtype)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


def train_rm(out: Path, suite: EnvSuite, spec: RmSpec, seed: int = 0, progress: Progress | None = None) -> dict[str, Any]:
    """Build and train the reward model in ``out``; returns its report (held-out pair accuracy)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    progress = progress or Progress.off()
    t0 = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    lab = _Labeller(suite)
    try:
        with progress.phase("building the untrained reward model"):
            build_untrained_rm(out, spec, seed)
        tok = AutoTokenizer.from_pretrained(str(out))
        model = AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32)
        rng = random.Random(seed)
        torch.manual_seed(seed)
        train, held = list(suite.train_tasks()), list(suite.eval_tasks())
        eval_pairs = _pairs(held, spec.eval_pairs, lab, random.Random(seed + 1))

        def pair_accuracy() -> float:
            model.eval()
            pos = scores(model, tok, [p + a for p, a, _ in eval_pairs])
            neg = scores(model, tok, [p + b for p, _, b in eval_pairs])
            model.train()
            return sum(x > y for x, y in zip(pos, neg)) / len(eval_pairs)

        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
        model.train()
        acc, step = 0.0, 0
        with progress.phase("training the reward model (Bradley-Terry on verifier-labelled pairs)",
                            total=spec.steps, unit="steps") as phase:
            for step in range(1, spec.steps + 1):
                batch = _pairs(train, spec.batch, lab, rng)
                inp, mask = encode_batch(tok, [p + a for p, a, _ in batch] + [p + b for p, _, b in batch])
                out_ = model(input_ids=inp, attention_mask=mask, output_hidden_states=spec.lm_weight > 0)
                s = out_.logits[:, 0]
                pos, neg = s[: len(batch)], s[len(batch):]
                loss = -F.logsigmoid(pos - neg).mean()
                if spec.lm_weight:
                    loss = loss + spec.lm_weight * _answer_lm_loss(model, tok, out_.hidden_states[-1][: len(batch)],
                                                                   inp[: len(batch)], mask[: len(batch)], batch)
                if spec.anchor:
                    loss = loss + spec.anchor * (F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos))
                                                 + F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg)))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                phase.advance(1, loss=float(loss.detach()))
                if step % spec.check_every == 0:
                    acc = pair_accuracy()
                    phase.note(pair_accuracy=acc)
                    log.info("reward model step %d: loss %.4f held-out pair accuracy %.3f", step, float(loss), acc)
                    if acc >= spec.target_pair_accuracy:
                        phase.finish(step)
                        break
        acc = pair_accuracy()
        model.eval()
        # pointwise: sigmoid(score) > 0.5 agrees with the verifier on held-out answers, half right, half wrong
        pos = scores(model, tok, [p + a for p, a, _ in eval_pairs])
        neg = scores(model, tok, [p + b for p, _, b in eval_pairs])
        point = (sum(x > 0 for x in pos) + sum(y <= 0 for y in neg)) / (2 * len(eval_pairs))
        model.save_pretrained(str(out), safe_serialization=True)
        return {"eval_pair_accuracy": acc, "eval_pointwise_accuracy": point, "steps": step,
                "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        lab.close()
        torch.set_num_threads(before)

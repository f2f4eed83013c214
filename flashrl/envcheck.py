"""What ``flashrl validate`` (and ``flashrl run``, before anything starts) checks of the environment beyond
its ``[env.params]``: the traps a config can set that would otherwise only show as a run that learns nothing.

    check_env(cfg) -> warnings; raises ValueError (a config error, exit 2) for
      - [env.params] the suite's Params refuses (flashrl.plugins.make_suite: env.params.<key>, or under the
        remote wrapper env.params.inner / env.params.params.<key>)
      - a WARM_START key flashrl.models.WarmStart does not have (flashrl.models.warm_start_of)
      - a multi-turn environment with rollout.max_turns = 1: every episode would be cut after its first
        action (a tool call, a first guess) and score 0
    warnings (printed, nothing refused):
      - rollout.max_turns below the turns the environment's episodes can take
      - with the built-in model, prompt, answer or demonstration text with characters its tokenizer lacks
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from flashrl.env import Demonstrating, MultiTurn, Wrapping

__all__ = ["check_env", "episode_turns", "foreign_chars"]

_SAMPLE = 32  # tasks (and demonstrations) looked at: enough to see a format, cheap for any suite


def _task_suite(suite: Any) -> Any:
    while isinstance(suite, Wrapping):
        suite = suite.task_suite
    return suite


def episode_turns(suite: Any) -> tuple[int, str]:
    """(the most turns an episode of ``suite`` takes, how that is known): the suite's ``max_turns``
    (flashrl.env.MultiTurn), else the longest of its demonstrations of the first train tasks
    (flashrl.env.Demonstrating), else 1 (a single-turn environment, as far as anything says)."""
    suite = _task_suite(suite)
    if isinstance(suite, MultiTurn) and isinstance(suite.max_turns, int) and not isinstance(suite.max_turns, bool):
        return suite.max_turns, "its max_turns"
    if isinstance(suite, Demonstrating):
        rng = random.Random(0)
        tasks = list(suite.train_tasks())[:_SAMPLE]
        most = max((len(suite.demonstration(t, rng).turns) for t in tasks), default=1)
        return most, "its demonstrations"
    return 1, ""


def foreign_chars(suite: Any, charset: str) -> dict[str, str]:
    """Characters outside ``charset`` in the first tasks' prompts and answers and in their demonstrations:
    {character: where first seen}."""
    suite = _task_suite(suite)
    allowed = set(charset)
    found: dict[str, str] = {}

    def look(text: str, where: str) -> None:
        for c in text:
            if c not in allowed and c not in found:
                found[c] = where

    rng = random.Random(0)
    for split in ("train_tasks", "eval_tasks"):
        for t in list(getattr(suite, split)())[:_SAMPLE]:
            look(t.prompt, f"the prompt of task {t.id!r}")
            look(t.answer, f"the answer of task {t.id!r}")
            if split == "train_tasks" and isinstance(suite, Demonstrating):
                for action, obs in suite.demonstration(t, rng).turns:
                    look(action + obs, f"the demonstration of task {t.id!r}")
    return found


def image_problem(cfg: Any, suite: Any, what: str) -> str:
    """Tasks with images (meta["images"]) and a model that cannot see them: the problem naming both and the fix;
    "" when fine (no images, builtin:vlm, a folder with a vision config and an image processor, or a folder
    not there yet: built later)."""
    from flashrl.vision.model import is_vision_model

    tasks = [t for split in ("train_tasks", "eval_tasks") for t in list(getattr(suite, split)())[:_SAMPLE]]
    with_images = next((t for t in tasks if (getattr(t, "meta", None) or {}).get("images")), None)
    if with_images is None or cfg.model.path == "builtin:vlm":
        return ""
    folder = Path(cfg.model.path).expanduser()
    if not (folder / "config.json").is_file() and not cfg.model.path.startswith("builtin:"):
        return ""
    has_processor = any((folder / f).is_file() for f in ("processor_config.json", "preprocessor_config.json"))
    if is_vision_model(folder) and has_processor:
        return ""
    why = ("has no image processor (processor_config.json / preprocessor_config.json)" if is_vision_model(folder)
           else "is a text-only model (no vision_config) without an image processor")
    return (f"model.path: {what} gives its prompts images (task {with_images.id!r} has meta['images']), but the "
            f"model {cfg.model.path!r} {why}, so it cannot see them; use model.path = \"builtin:vlm\" or a "
            "vision-language model folder with its processor (docs/models.md: vision-language models)")


def freeze_problem(cfg: Any) -> str:
    """``[vision] freeze`` on a model with no vision tower: the problem and the fix; "" otherwise (or when the
    folder is not there yet)."""
    from flashrl.vision.model import is_vision_model

    vision = getattr(cfg, "vision", None)
    if not getattr(vision, "freeze", False) or cfg.model.path == "builtin:vlm":
        return ""
    folder = Path(cfg.model.path).expanduser()
    if not cfg.model.path.startswith("builtin:") and not (folder / "config.json").is_file():
        return ""
    if is_vision_model(folder):
        return ""
    return (f"vision.freeze: the model {cfg.model.path!r} has no vision tower (no vision_config) to freeze; set "
            "[vision] freeze = false, or use builtin:vlm or a vision-language model folder")


def check_env(cfg: Any) -> list[str]:
    """Build the suite ``cfg`` names and check it against the config (module docstring); the warnings."""
    from flashrl.models import BUILTIN_MODELS, warm_start_of
    from flashrl.plugins import make_suite

    env = cfg.env
    suite = make_suite(env.name, env.params, cfg.run.seed, env.eval_size)
    warm_start_of(env.name, env.params)
    warnings: list[str] = []
    turns, known = episode_turns(suite)
    have = cfg.rollout.max_turns
    what = f"env {env.name!r}" + (f" (inner {env.params.get('inner')!r})" if isinstance(suite, Wrapping) else "")
    if turns > 1 and have == 1:
        raise ValueError(
            f"rollout.max_turns: {what} is multi-turn (an episode takes up to {turns} turns, by {known}), but "
            f"rollout.max_turns = 1 ends every episode after its first action, before the environment can "
            f"answer it (reward 0); set max_turns = {turns} in [rollout] (docs/environments.md)")
    if turns > have:
        warnings.append(f"rollout.max_turns = {have} cuts the episodes of {what}, which take up to {turns} turns "
                        f"(by {known}): an episode past it ends unfinished; raise rollout.max_turns to {turns}")
    if problem := image_problem(cfg, suite, what) or freeze_problem(cfg):
        raise ValueError(problem)
    if cfg.model.path in BUILTIN_MODELS:
        from flashrl.models.tokenizer import CHARSET

        bad = foreign_chars(suite, CHARSET)
        if bad:
            shown = ", ".join(f"{c!r} ({where})" for c, where in list(bad.items())[:5])
            warnings.append(f"{what}: the built-in model's tokenizer has no token for {len(bad)} character(s) its "
                            f"text uses: {shown}; each reads as <unk> and is lost in decoding, so the model can "
                            "neither see nor write it (docs/models.md: the built-in model's characters)")
    return warnings

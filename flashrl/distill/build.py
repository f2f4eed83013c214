"""A teacher's model folder, and whether it speaks the student's vocabulary.

    teacher_folder(cfg, tc)
      "builtin:teacher" -> the built-in model (flashrl.models.ensure_model: the same shape and char tokenizer as
                           builtin:tiny) warm-started on *exact* answers: the warm-start's teacher_carry_slip = 0
                           (the default student's warm-start imitates a teacher that forgets the units carry 65% of
                           the time), until 97% probe accuracy or 6000 steps; built with the teacher's own seed
                           (teacher.seed, default 0), so every run seed shares one teacher; cached like the student
      a folder          -> it must hold config.json of a causal LM (else TeacherModelError)
    vocabulary_problem(student, teacher, name) -> "" or why the teacher cannot score the student's tokens: its
                           tokenizer's vocabulary (token -> id) or the model's vocab_size differs from the student's
                           (both named); a teacher's log-probability of token id t is only the student's token t's when
                           both map every id to the same string

Why the vocabularies must match: the teacher scores the token ids the student generated. With another tokenizer
the same id is another string (or out of range), and its log-probability is of something the student never wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from flashrl.distill.config import BUILTIN_TEACHER, TeacherConfig
from flashrl.models.progress import Progress

__all__ = ["TeacherModelError", "builtin_teacher_warm", "teacher_folder", "vocabulary_problem"]


class TeacherModelError(FileNotFoundError):
    """A teacher's model does not name a usable folder; the message says which and how to fix it."""


def builtin_teacher_warm(cfg: Any) -> Any:
    """builtin:teacher's warm-start: the environment's, with an exact teacher, trained to 97% probe accuracy."""
    from flashrl.models import _task_params, warm_start_of

    warm = warm_start_of(cfg.env.name, _task_params(cfg))
    return msgspec.structs.replace(warm, teacher_carry_slip=0.0, target_accuracy=0.97, min_steps=0,
                                   max_steps=max(warm.max_steps, 6000))


def teacher_folder(cfg: Any, tc: TeacherConfig, progress: Progress | None = None, build: bool = True) -> Path:
    """The folder teacher ``tc`` serves (built first when it is builtin:teacher and ``build``)."""
    if tc.model == BUILTIN_TEACHER:
        from flashrl.models import BUILTIN_TINY, ensure_model

        tcfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, seed=tc.seed),
                                       model=msgspec.structs.replace(cfg.model, path=BUILTIN_TINY))
        return ensure_model(tcfg, warm=builtin_teacher_warm(cfg), progress=progress, build=build)
    p = Path(tc.model).expanduser()
    key = f"distill.teachers[{tc.name}].model"
    if not (p / "config.json").is_file():
        what = "does not exist" if not p.exists() else "holds no config.json"
        raise TeacherModelError(f"{key}: {str(p)!r} {what}; set it to a local Hugging Face causal-LM folder "
                                f"(config.json, weights, the student's tokenizer) or to {BUILTIN_TEACHER!r}")
    archs = [str(a) for a in json.loads((p / "config.json").read_text()).get("architectures") or []]
    if archs and not any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in archs):
        raise TeacherModelError(f"{key}: {str(p)!r} is a {', '.join(archs)}; a teacher scores tokens, so it must be "
                                "a causal LM (*ForCausalLM)")
    return p


def _vocab(folder: Path) -> tuple[dict[str, int], int | None]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    conf = json.loads((folder / "config.json").read_text())
    size = conf.get("vocab_size", (conf.get("text_config") or {}).get("vocab_size"))
    return dict(tok.get_vocab()), (int(size) if size is not None else None)


def vocabulary_problem(student: Path, teacher: Path, name: str) -> str:
    """Why teacher ``name`` (folder ``teacher``) cannot score the student's (``student``) tokens, or ""."""
    try:
        s_vocab, s_size = _vocab(student)
        t_vocab, t_size = _vocab(teacher)
    except Exception as e:  # a folder whose tokenizer does not load
        return f"distill.teachers[{name}]: its tokenizer or the student's does not load: {type(e).__name__}: {e}"
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab) - set(t_vocab))[:3]
        moved = sorted(k for k in set(s_vocab) & set(t_vocab) if s_vocab[k] != t_vocab[k])[:3]
        return (f"distill.teachers[{name}]: the teacher's tokenizer ({teacher}, {len(t_vocab)} tokens) is not the "
                f"student's ({student}, {len(s_vocab)} tokens): " + (f"tokens only the student has: {only_s}; " if only_s else "")
                + (f"tokens with other ids: {moved}; " if moved else "")
                + "the teacher would score other strings than the student wrote; use a teacher of the student's "
                "family (the same tokenizer)")
    if s_size is not None and t_size is not None and s_size != t_size:
        return (f"distill.teachers[{name}]: the teacher's vocab_size {t_size} ({teacher}) is not the student's "
                f"{s_size} ({student}); the same tokenizer with another embedding size is refused too: their "
                "log-probabilities are over different sets of ids")
    return ""

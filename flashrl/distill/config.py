"""``[distill]``: on-policy distillation's section, owned here (flashrl/config.py holds one line for it).

    [distill]
    mode = "kl"                 # "kl": the teacher's signal alone; "reward+kl": beside the task's reward
    kl_weight = 1.0             # lambda of the per-token reverse-KL term of the advantage
    teacher_key = "teacher"     # several teachers: the task's meta[teacher_key] names the one for its prompt

    [[distill.teachers]]        # one table per teacher; the first is the default
    name = "exact"
    model = "builtin:teacher"   # or a local Hugging Face causal-LM folder with the student's tokenizer
    engines = 1

``check`` holds the rules msgspec's bounds cannot express; flashrl/config.py calls it with the other sections'.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

__all__ = ["BUILTIN_TEACHER", "DistillConfig", "TeacherConfig", "check"]

BUILTIN_TEACHER = "builtin:teacher"


class _Section(Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class TeacherConfig(_Section):
    """``[[distill.teachers]]``: one teacher, a causal LM served by vLLM engine processes of its own, never updated."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description=(
        "the teacher's name: metrics (env/teacher_<name>_*), logs, samples.jsonl, and the value of a task's "
        "meta[distill.teacher_key] that picks it"))] = "teacher"
    model: Annotated[str, Meta(description=(
        '"builtin:teacher" (the built-in model warm-started on exact answers: the carry the default student\'s '
        "warm-start forgets) or a local Hugging Face causal-LM folder whose tokenizer is the student's"))] = ""
    engines: Annotated[int, Meta(ge=1, le=64, description=(
        "the teacher's engine processes (vLLM), placed by cluster.launcher beside the judge's (the launchers' "
        '"judge" role: judge engines first, then each teacher\'s in order)'))] = 1
    top_k: Annotated[int, Meta(ge=0, le=20, description=(
        "the teacher's k most likely tokens at every generated position, kept in each trajectory's teacher_top "
        "(samples and checkpoints carry them; 0 = the sampled token's log-probability only)"))] = 0
    timeout_s: Annotated[float, Meta(gt=0, le=86_400, description="deadline of one scoring request")] = 60.0
    retries: Annotated[int, Meta(ge=0, le=100, description=(
        "retries of a sample's scoring after its engine died, hung or answered garbage (counted apart: "
        "env/teacher_retries); past them the sample fails (rollout/failed_teacher_<reason>), never trained without"))] = 3
    max_restarts: Annotated[int, Meta(ge=0, le=1000, description=(
        "restarts of this teacher's engines in the run; with every engine down and these spent the run stops "
        "(TeacherDown, exit 3)"))] = 5
    kv_cache_gib: Annotated[float, Meta(gt=0, description="CPU KV cache per teacher engine in GiB")] = 0.25
    max_num_seqs: Annotated[int, Meta(ge=1, description="concurrent sequences per teacher engine")] = 256
    threads: Annotated[int, Meta(ge=1, description="CPU threads per teacher engine (cpu)")] = 1
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1, description=(
        "fraction of GPU memory per teacher engine (cuda; the teacher runs on engine.device)"))] = 0.5
    startup_timeout_s: Annotated[float, Meta(gt=0, le=86_400, description="deadline for a teacher engine to come up")] = 600.0
    seed: Annotated[int, Meta(ge=0, description=(
        "builtin:teacher: the seed of its build (every run seed shares one teacher)"))] = 0


class DistillConfig(_Section):
    """``[distill]``: on-policy distillation (docs/distillation.md). No teachers: off."""

    teachers: Annotated[list[TeacherConfig], Meta(description=(
        "the teachers, one [[distill.teachers]] table each (empty = no distillation); the first is the default"))] = []
    mode: Annotated[Literal["kl", "reward+kl"], Meta(description=(
        '"kl": the advantage of each generated token is -kl_weight x (log pi_student - log pi_teacher) alone '
        '(pure distillation; the task\'s reward is still logged); "reward+kl": that term added to the task\'s '
        "GRPO (or critic) advantage"))] = "reward+kl"
    kl_weight: Annotated[float, Meta(gt=0, le=1000, description=(
        "lambda: the weight of the per-token reverse-KL estimate in the advantage"))] = 1.0
    forward_kl_coef: Annotated[float, Meta(ge=0, le=1000, description=(
        "> 0: also a forward-KL loss term with this weight, at every generated position the teacher's top-k "
        "distribution against the student's (every teacher's top_k > 0; these gradient forwards are padded ones: "
        "trainer.share_prefix does not apply to them); 0 = off"))] = 0.0
    teacher_key: Annotated[str, Meta(min_length=1, description=(
        "several teachers: the key of Task.meta (a dataset column) whose value names the prompt's teacher; a task "
        "without it gets the first teacher"))] = "teacher"

    @property
    def on(self) -> bool:
        return bool(self.teachers)

    def teacher_of(self, meta: dict[str, Any]) -> str:
        """The name of the teacher a task with ``meta`` is scored by."""
        return str(meta.get(self.teacher_key, self.teachers[0].name))


def check(cfg: Any, source: str, error: type[Exception]) -> None:
    """[distill]'s cross-field rules: ``error`` (ConfigError) names the key and the fix."""
    dc: DistillConfig = cfg.distill
    if not dc.teachers:
        if dc != DistillConfig():
            raise error(f"{source}: distill: options of distillation, but distill.teachers is empty; add a "
                        "[[distill.teachers]] table (model = \"builtin:teacher\" or a causal-LM folder) or remove [distill]")
        return
    names = [t.name for t in dc.teachers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise error(f"{source}: distill.teachers: the name {dup[0]!r} is given to more than one teacher; name each "
                    "[[distill.teachers]] table apart (name = ...)")
    for i, t in enumerate(dc.teachers):
        if not t.model:
            raise error(f"{source}: distill.teachers[{i}].model: empty; set it to \"builtin:teacher\" or a local "
                        "causal-LM folder")
        if t.model == BUILTIN_TEACHER and cfg.model.path != "builtin:tiny":
            raise error(f"{source}: distill.teachers[{i}].model: \"builtin:teacher\" speaks the built-in model's "
                        f"tokenizer, but model.path = {cfg.model.path!r}; give a teacher folder with that model's "
                        "tokenizer")
    if dc.forward_kl_coef > 0:
        without = [t.name for t in dc.teachers if t.top_k == 0]
        if without:
            raise error(f"{source}: distill.forward_kl_coef = {dc.forward_kl_coef} needs each teacher's top-k "
                        f"distribution, but teacher {without[0]!r} has top_k = 0; set its top_k (e.g. 8) or "
                        "distill.forward_kl_coef = 0")
    if cfg.rollout.temperature != 1.0:
        raise error(f"{source}: rollout.temperature = {cfg.rollout.temperature}: distillation compares the student's "
                    "log-probability of each sampled token with the teacher's, both at temperature 1 (the teacher "
                    "scores untempered); set rollout.temperature = 1.0")
    if cfg.rollout.top_p < 1.0:
        raise error(f"{source}: rollout.top_p = {cfg.rollout.top_p}: distillation needs the student's full "
                    "distribution (its behaviour log-probabilities are the nucleus's otherwise); set rollout.top_p = 1.0")
    if dc.mode == "kl" and (cfg.reward.model or cfg.judge.model):
        key = "reward.model" if cfg.reward.model else "judge.model"
        raise error(f"{source}: {key}: a model reward is scored for every episode, but distill.mode = \"kl\" trains on "
                    "the teacher's signal alone; set distill.mode = \"reward+kl\" or remove the model reward")
    if dc.mode == "kl" and cfg.algorithm.credit != "none":
        raise error(f"{source}: algorithm.credit = {cfg.algorithm.credit!r} scales the reward's advantage, and "
                    "distill.mode = \"kl\" has none; set distill.mode = \"reward+kl\" or algorithm.credit = \"none\"")

"""On-policy distillation: teachers beside the policy score every token it sampled; the per-token reverse KL
(log pi_student - log pi_teacher) enters the advantage, beside the task's reward or alone.

    config.py   [distill] and [[distill.teachers]] (DistillConfig, TeacherConfig) and their cross-field rules
    build.py    builtin:teacher (the built-in model warm-started on exact answers), a folder's check, and whether
                a teacher's vocabulary is the student's
    engines.py  TeacherEngines: one teacher's engine processes (flashrl/engine/served.py), Score requests, a hung or
                garbage-answering engine recycled
    client.py   Teachers: a finished training rollout scored whole by its prompt's teacher, retried, counted
    fake.py     FakeTeacherEngines: a stand-in with a scoring function, failures on demand (unit tests)
    the signal  flashrl/trainer/step.py (``distill_advantages``): A[t] (+)= -kl_weight * (behav_logp[t] -
                teacher_logp[t]) on every generated token; a sample without its teacher's scores is refused

Where it runs: controller/rollout.py ``run_sample`` awaits ``Teachers.score`` once a training rollout is finished
(its engine permit already given back): scoring overlaps generation and training like any other rollout's wait.
docs/distillation.md tells the whole story.
"""

from __future__ import annotations

from typing import Any

__all__ = ["start_teachers"]


async def start_teachers(cfg: Any, student: Any, progress: Any = None, launcher: Any = None, device: str = "cpu",
                         gpus: list[str | None] | None = None) -> Any:
    """The run's Teachers (None without [[distill.teachers]]): each teacher's folder built or checked, its vocabulary
    checked against the student's folder ``student`` (TeacherModelError naming both), its engines started in the
    background, placed by ``launcher`` after the judge's (launcher role "judge"), on ``device``; teacher engine
    j of the run on ``gpus[j]`` (cuda, local launcher; None: unpinned)."""
    if not cfg.distill.on:
        return None
    import asyncio

    from flashrl.distill.build import TeacherModelError, teacher_folder, vocabulary_problem
    from flashrl.distill.client import Teachers
    from flashrl.distill.engines import TeacherEngines

    logs = cfg.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    index0 = cfg.judge.engines if cfg.judge.model else 0
    pools: dict[str, Any] = {}
    for tc in cfg.distill.teachers:
        folder = await asyncio.to_thread(teacher_folder, cfg, tc, progress)
        problem = await asyncio.to_thread(vocabulary_problem, student, folder, tc.name)
        if problem:
            raise TeacherModelError(problem)
        j = index0 - (cfg.judge.engines if cfg.judge.model else 0)  # this teacher's first engine among the run's
        mine = gpus[j : j + tc.engines] if gpus else None
        pools[tc.name] = TeacherEngines(tc, folder, logs, max_model_len=cfg.model.max_model_len, seed=cfg.run.seed,
                                        launcher=launcher, device=device, gpus=mine, index0=index0)
        index0 += tc.engines
    teachers = Teachers(cfg.distill, pools)
    await teachers.start()
    return teachers

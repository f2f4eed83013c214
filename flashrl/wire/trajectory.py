"""The trajectory record: what one rollout is, written once for every part that holds one.

    controller/rollout.py ──Trajectory──> controller/buffer.py ──> TrainBatch.samples (wire/protocol.py)
                                          │                          └──> trainer/batch.py (pad_batch)
                                          └── a checkpoint's cut ──> rollouts.msgpack (checkpoint.py,
                                                                     ``SavedGroup``), read back on resume

The controller keeps it, a checkpoint saves it (``snapshot``: a copy without the timings of the process
that generated it) and the trainer's batch builder reads it: no second field list, no converter.
Adding a per-token field (``top_logprobs`` is one) is a field here plus the code that fills it (the
engine's reply, controller/rollout.py) and the code that reads it (trainer/batch.py); the checkpoint
keeps it with no change of its own, and a checkpoint written before the field existed decodes with the
field's default.

Invariant: ``loss_mask``, ``behav_logp`` and ``versions`` have one entry per ``response_ids`` token
(generated tokens: mask 1, the engine's logprob and policy version; observation tokens: mask 0, 0.0,
-1), so ``version_start`` (the staleness bound's input) is the version of the first generated token.
``top_logprobs`` is empty (engine.top_logprobs = 0, the default) or has one entry per ``response_ids``
token too: the engine's k most likely (token id, logprob) pairs there, [] on observation tokens.
``teacher_logp`` (and ``teacher_top``) follow the same rule: empty (no teacher) or one entry per ``response_ids``
token, the teacher's values on generated tokens and 0.0 ([]) on observation tokens.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = ["NOT_SAVED", "Image", "Trajectory", "snapshot"]


class Image(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """One image of a prompt as the wire carries it (flashrl/vision/images.py ImageRef; msgspec takes no
    ``bytes | str`` union): its encoded PNG/JPEG bytes, or a file path."""

    data: bytes = b""
    path: str = ""

    def ref(self) -> bytes | str:
        return self.data or self.path


class Trajectory(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One rollout: token ids, per-token data, outcome, lineage and timings."""

    sample_id: str = ""
    group: int  # prompt uid (admission index); eval rollouts use -1 - task position
    index: int = 0  # sample index inside the group (seeds, ordering)
    prompt_ids: list[int] = []
    response_ids: list[int] = []
    # per response token (the invariant above)
    loss_mask: list[int] = []
    behav_logp: list[float] = []
    versions: list[int] = []
    top_logprobs: list[list[tuple[int, float]]] = []  # engine.top_logprobs > 0 only
    # on-policy distillation (flashrl/distill): the teacher's log-probability of each response token (0.0 on
    # observation tokens), and (its top_k > 0) its k most likely tokens there ([] on observation tokens); filled
    # once the rollout is finished, scored whole; empty without a teacher
    teacher_logp: list[float] = []
    teacher_top: list[list[tuple[int, float]]] = []
    teacher: str = ""  # the name of the teacher that scored it
    reward: float = 0.0
    correct: bool = False  # StepResult.info["correct"] when the env says, else reward >= 1
    finish_reason: str = ""  # engine's "stop"/"length", or "max_turns", "max_model_len"
    turns: int = 0
    status: Literal["ok", "failed"] = "ok"
    failure: str = ""  # counter name of the failure when status == "failed"
    # lineage: where and when it was generated, and how often it was continued
    engine: str = ""
    attempts: int = 1
    version_sent: int = 0  # controller version when the last attempt began
    task_id: str = ""
    restored: int = 0  # resumes that continued it from a checkpoint's snapshot (its tokens before kept)
    t_start: float = 0.0
    t_end: float = 0.0
    gen_s: float = 0.0  # inside engine.generate
    env_s: float = 0.0  # inside env.reset / env.step
    wait_s: float = 0.0  # waiting for an engine permit
    teacher_s: float = 0.0  # from the end of the rollout to its teacher's scores (retries included)
    metrics: dict[str, float] = {}  # StepResult.info["metrics"] (e.g. a reward function's extras), last value per key
    # Multi-turn chat trajectories (rollout._measure_template), -1 where not measured: tokens by which the
    # chat template's re-rendering of the finished conversation differs from prompt_ids + response_ids,
    # and tokens that decoding and re-encoding its generated turns alone would change.
    template_mismatch: int = -1
    retokenize_mismatch: int = -1
    # a MoE policy's routes (flashrl/moe/routes.py), one packed row per response token (b"" on observation
    # tokens); empty when the run captures none. Kept by checkpoints like the other per-token fields.
    routes: list[bytes] = []
    # a vision-language sample's images (flashrl/vision): references (PNG/JPEG bytes or a file path) in sequence
    # order, the prompt's then each observation's (StepResult.images); prompt_ids and the observation tokens of
    # response_ids hold each image's expansion (what the engine served and the trainer forwards)
    images: list[Image] = []

    @property
    def version_start(self) -> int:
        """Version of the first generated token (the staleness bound is on this)."""
        for m, v in zip(self.loss_mask, self.versions):
            if m:
                return v
        return self.version_sent

    @property
    def n_generated(self) -> int:
        return sum(self.loss_mask)

    def generated_versions(self) -> list[int]:
        """The policy version of each generated token, in order (observation tokens left out)."""
        return [v for v, m in zip(self.versions, self.loss_mask) if m]


# The fields a checkpoint does not keep: the outcome of the attempt and the timings of the process that
# generated it (a resumed run starts them afresh).
NOT_SAVED = ("status", "failure", "t_start", "t_end", "gen_s", "env_s", "wait_s", "teacher_s")
_BLANK = Trajectory(group=0)


def snapshot(t: Trajectory) -> Trajectory:
    """``t`` as a checkpoint keeps it: every field but ``NOT_SAVED`` (those back at their defaults), copied:
    a rollout that goes on after the cut appends to its own lists in place, never to the snapshot's."""
    return Trajectory(**{f: getattr(_BLANK, f) if f in NOT_SAVED else _copy(getattr(t, f))
                         for f in Trajectory.__struct_fields__})


def _copy(v: Any) -> Any:
    return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v

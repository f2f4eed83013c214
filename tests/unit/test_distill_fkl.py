"""The forward-KL term of on-policy distillation (flashrl/trainer/distill.py): its value is the KL from the teacher's
top-k to the student there, and its gradient pulls the student toward the teacher's top token."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flashrl.trainer.batch import pad_batch
from flashrl.trainer.distill import forward_kl, forward_with_top
from flashrl.wire.trajectory import Trajectory


def _sample(top: list[list[tuple[int, float]]]) -> Trajectory:
    n = len(top)
    return Trajectory(group=0, prompt_ids=[1, 10, 11], response_ids=[20 + k for k in range(n)], loss_mask=[1] * n,
                      behav_logp=[-1.0] * n, versions=[0] * n, teacher_logp=[-0.1] * n, teacher_top=top)


def test_the_value_is_the_kl_from_the_teachers_top_k() -> None:
    top = [[(5, math.log(0.7)), (6, math.log(0.2))], [(7, math.log(0.9)), (8, math.log(0.1))]]
    b = pad_batch([_sample(top)], pad_id=0)
    student = torch.full(b.teacher_top_logp.shape, math.log(0.5))
    loss, met = forward_kl(student, b, None)
    want = (0.7 * math.log(0.7 / 0.5) + 0.2 * math.log(0.2 / 0.5) + 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)) / 2
    assert float(loss) == pytest.approx(want, rel=1e-5) and met["distill/forward_kl"] == pytest.approx(want, rel=1e-5)
    assert float(forward_kl(b.teacher_top_logp.clone(), b, None)[0]) == pytest.approx(0.0, abs=1e-7)


def test_its_gradient_pulls_the_student_toward_the_teachers_token(model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    b = pad_batch([_sample([[(33, math.log(0.95))], [(34, math.log(0.95))]])], pad_id=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def teacher_tokens_logp() -> float:
        with torch.no_grad():
            return float(forward_with_top(model, b, False, 1.0)[2].sum())

    before = teacher_tokens_logp()
    for _ in range(3):
        _, _, top = forward_with_top(model, b, False, 1.0)
        loss, _ = forward_kl(top, b, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert teacher_tokens_logp() > before + 0.5
    masked = dataclasses.replace(b, loss_mask=torch.zeros_like(b.loss_mask))
    assert float(forward_kl(forward_with_top(model, masked, False, 1.0)[2], masked, None)[0]) == 0.0

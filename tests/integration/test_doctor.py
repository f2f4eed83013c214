"""`flashrl doctor --gpu` (flashrl/doctor.py): on this CPU machine the CUDA checks SKIP cleanly (exit 0), and
the same checks run on the CPU with gloo (``--device cpu``), so the check code itself is exercised here: the
trainer step, its weight packing, DCP save/load and the weight-sync broadcast pass, and a broken check FAILs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flashrl import doctor
from flashrl.cli import app
from flashrl.doctor import Check, WorkerSpec, run_checks


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the GPU checks would run")
def test_gpu_checks_skip_cleanly_without_cuda() -> None:
    res = CliRunner().invoke(app, ["doctor", "--gpu"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.split("  ")[0] in ("PASS", "FAIL", "SKIP")]
    names = [ln.split("  ")[1] for ln in lines]
    assert names == ["cuda", "weights", "trainer[world 1]", "pack[world 1]", "dcp[world 1]", "dcp-async[world 1]",
                     "trainer[world 2]", "pack[world 2]", "dcp[world 2]", "dcp-async[world 2]", "broadcast"]
    assert all(ln.startswith("SKIP  ") for ln in lines), res.output
    assert "no CUDA" in res.output


def test_cpu_checks_pass(tmp_path: Path) -> None:
    """The checks on the CPU (gloo), world 1 (world 2 runs under `flashrl doctor --device cpu`)."""
    seen: list[Check] = []
    checks = run_checks("cpu", timeout_s=300, workdir=str(tmp_path), on_check=seen.append, worlds=(1,))
    assert seen == checks
    by = {c.name: c for c in checks}
    assert list(by) == ["cuda", "weights", "trainer[world 1]", "pack[world 1]", "dcp[world 1]", "dcp-async[world 1]",
                        "broadcast"]
    assert by["cuda"].status == "SKIP"
    for name in list(by)[1:]:
        assert by[name].status == "PASS", by[name]
    assert "GB/s" in by["broadcast"].detail and "restored exactly" in by["dcp[world 1]"].detail
    assert "step 1's weights restored exactly" in by["dcp-async[world 1]"].detail


def test_a_broken_checksum_fails_the_weights_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashrl.wire.weights as w

    assert doctor.weights_check("cpu").status == "PASS"
    monkeypatch.setattr(w, "verify_checksum", lambda flat, expected: expected)  # accepts anything
    c = doctor.weights_check("cpu")
    assert c.status == "FAIL" and "a changed element kept the checksum" in c.detail, c


def test_a_failing_child_is_a_fail_line_with_its_error(tmp_path: Path) -> None:
    spec = WorkerSpec(job="trainer", device="cpu", model=str(tmp_path / "no-model"), workdir=str(tmp_path),
                      report=str(tmp_path / "r.jsonl"))
    checks = doctor._spawn(spec, 1, ["trainer[world 1]"], timeout_s=300)
    assert [c.status for c in checks] == ["FAIL"]
    assert "rank 0 exit 1" in checks[0].detail and "no-model" in checks[0].detail, checks[0]
    # a child past its deadline is killed and its check FAILs, naming the deadline
    checks = doctor._spawn(spec, 1, ["trainer[world 1]"], timeout_s=0.2)
    assert checks[0].status == "FAIL" and "timed out after 0s" in checks[0].detail, checks[0]


def test_any_fail_exits_non_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "run_checks", lambda *a, **k: [Check("cuda", "PASS"), Check("weights", "FAIL", "x")])
    res = CliRunner().invoke(app, ["doctor", "--gpu"])
    assert res.exit_code == 1 and "FAILED: weights" in res.output, res.output

"""Export: the policy as a Hugging Face folder, from a state dict (the run's final) or a DCP checkpoint.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_export.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from flashrl.cli import app
from flashrl.config import from_dict, to_toml
from flashrl.models.export import ExportError, export_run
from flashrl.wire.transport import free_port
from tests.unit import test_export
from tests.unit.test_export import _load

chat_dir = test_export.chat_dir  # the unit module's fixture, shared


@pytest.fixture()
def world1():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_export_reads_final_or_a_dcp_checkpoint(world1, tmp_path: Path, chat_dir: Path) -> None:
    """A run folder as `flashrl run` leaves it: final/ (HF) and checkpoints/step-N/trainer (DCP)."""
    from flashrl.trainer.worker import Trainer
    from flashrl.wire.protocol import TrainBatch
    from flashrl.wire.trajectory import Trajectory

    cfg = from_dict({"run": {"output_dir": str(tmp_path), "name": "r"}, "model": {"path": str(chat_dir)},
                     "trainer": {"backend": "gloo", "lr": 1e-2, "threads": 1}})
    run = cfg.run_dir
    run.mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(cfg))
    with pytest.raises(ExportError, match="no final policy .* and no checkpoints"):
        export_run(run, tmp_path / "x")

    t = Trainer(cfg, str(chat_dir), torch.device("cpu"))
    samples = [Trajectory(prompt_ids=[1, 5, 6], response_ids=[7, 8, 2], loss_mask=[1, 1, 1], behav_logp=[-3.0] * 3,
                           versions=[0] * 3, reward=float(r), group=0) for r in (0, 1)]
    t.train_step(TrainBatch(step=0, samples=samples))
    t.save_checkpoint(str(run / "checkpoints" / "step-1" / "trainer"))
    at_1 = {k: v.clone() for k, v in t.full_state_dict().items()}
    t.train_step(TrainBatch(step=1, samples=samples))
    t.save_model(str(run / "final"))
    final = t.full_state_dict()
    assert not torch.equal(at_1["model.norm.weight"], final["model.norm.weight"])

    out, what = export_run(run, tmp_path / "final-export")
    assert what.startswith("final policy")
    got = _load(out).state_dict()
    assert all(torch.equal(got[k], final[k]) for k in final)

    out, what = export_run(run, tmp_path / "step1", step=1)
    assert what.startswith("checkpoint step 1")
    got = _load(out).state_dict()
    assert all(torch.equal(got[k], at_1[k]) for k in at_1)

    with pytest.raises(ExportError, match=r"no checkpoint for step 7 \(checkpoints: 1\)"):
        export_run(run, tmp_path / "s7", step=7)
    with pytest.raises(ExportError, match="already exists"):
        export_run(run, tmp_path / "step1")

    # the CLI: exit 2 with the message on a problem, the folder on success
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "s7"), "--step", "7"])
    assert res.exit_code == 2 and "no checkpoint for step 7" in res.output
    res = CliRunner().invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "y")])
    assert res.exit_code == 2 and "not a run folder" in res.output
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "cli")])
    assert res.exit_code == 0 and "exported final policy" in res.output
    assert (tmp_path / "cli" / "model.safetensors").is_file()

"""The dataset environment (envs/dataset.py): formats, column mapping, template, splits, bad rows,
params validation, rewards as infrastructure failures, and the controller's view of it (reward
metrics per step, samples) on fake engines."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from flashrl.cli import app
from flashrl.config import Config
from flashrl.controller.controller import Controller
from flashrl.controller.scheduler import DataStream
from flashrl.env import EnvFailure
from flashrl.plugins import PluginError, make_suite
from flashrl.sim.fake import FakeEngine, FakeTokenizer, FakeTrainer, default_script

ROWS = [{"id": f"p{i}", "q": f"{i}+{i}", "a": 2 * i, "level": i % 3} for i in range(20)]


def jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def suite(path: Path | str, seed: int = 0, eval_size: int = 100, **params: Any) -> Any:
    base = {"path": str(path), "prompt": "q", "answer": "a"}
    return make_suite("dataset", base | params, seed, eval_size)


def test_jsonl_mapping_template_and_extra(tmp_path: Path) -> None:
    s = suite(jsonl(tmp_path / "d.jsonl", ROWS), id="id", extra=["level"], template="L{level}: {prompt}=", eval_fraction=0)
    t = s.train_tasks()[3]
    assert (t.id, t.prompt, t.answer, t.meta["level"]) == ("p3", "L0: 3+3=", "6", 0)
    assert s.row(t) == {"id": "p3", "prompt": "L0: 3+3=", "answer": "6", "level": 0}
    assert s.eval_tasks() == [] and len(s.train_tasks()) == 20 and s.counters == {}


def test_bad_rows_are_counted_and_reported_with_line_numbers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = [ROWS[0], "{not json", ROWS[1], {"id": "x1", "q": "", "a": 1}, {"id": "x2", "a": 3}, [1, 2],
            {"id": "x3", "q": "x", "a": [1]}, {"id": "x4", "q": 5, "a": 1}, "", {"id": "p0", "q": "dup", "a": 1}, ROWS[2]]
    with caplog.at_level(logging.WARNING):
        s = suite(jsonl(tmp_path / "d.jsonl", rows), id="id", eval_fraction=0)
    assert [t.id for t in s.train_tasks()] == ["p0", "p1", "p2"]
    assert s.counters["bad_rows"] == 7  # the blank line is not a row
    msg = caplog.text
    for part in ("d.jsonl: 7 bad row(s) not used, 3 used", "line 2: invalid JSON", "line 4: empty prompt",
                 "line 5: missing column 'q'", "line 6: a JSON list, not an object",
                 "line 7: column 'a' (answer) is a list", "line 8: column 'q' (prompt) is a int",
                 "line 10: duplicate id 'p0'"):
        assert part in msg, part
    assert str(s.bad_rows[0]).startswith(f"{tmp_path / 'd.jsonl'}: line 2: invalid JSON (JSON is malformed: ")


def test_a_file_with_no_usable_row_is_an_error_naming_it(tmp_path: Path) -> None:
    p = jsonl(tmp_path / "bad.jsonl", [{"question": "1+1", "a": 2}] * 3)
    with pytest.raises(ValueError, match=r"env\.params\.path: .*bad\.jsonl has no usable row \(3 bad: line 1: missing column 'q'"):
        suite(p)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl has no usable row \(0 bad, it is empty\)"):
        suite(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match=r"env\.params\.path: 'missing\.jsonl' not found"):
        suite("missing.jsonl")


def test_seeded_fraction_split_and_split_by_file(tmp_path: Path) -> None:
    p = jsonl(tmp_path / "d.jsonl", ROWS)
    a, b, c = suite(p, seed=0, eval_fraction=0.25), suite(p, seed=0, eval_fraction=0.25), suite(p, seed=1, eval_fraction=0.25)
    ids = lambda ts: [t.id for t in ts]  # noqa: E731
    assert len(a.eval_tasks()) == 5 and len(a.train_tasks()) == 15
    assert not set(ids(a.eval_tasks())) & set(ids(a.train_tasks()))
    assert ids(a.eval_tasks()) == ids(b.eval_tasks()) and ids(a.eval_tasks()) != ids(c.eval_tasks())
    assert len(suite(p, eval_fraction=0.25, eval_size=2).eval_tasks()) == 2  # env.eval_size caps it
    e = jsonl(tmp_path / "e.jsonl", [{"q": "9+9", "a": 18}])
    s = suite(p, eval_path=str(e))
    assert len(s.train_tasks()) == 20 and [t.prompt for t in s.eval_tasks()] == ["9+9"]
    with pytest.raises(ValueError, match="eval_fraction: 0.9 of 1 usable rows leaves none"):
        suite(e, eval_fraction=0.9)


def test_epochs_are_shuffled_seeded_by_the_controller(tmp_path: Path) -> None:
    s = suite(jsonl(tmp_path / "d.jsonl", ROWS), eval_fraction=0)
    def order(seed: int) -> list[list[str]]:
        d = DataStream(s.train_tasks(), seed)
        return [[d.next()[1].id for _ in range(20)] for _ in range(2)]
    e0, e1 = order(0)
    assert sorted(e0) == sorted(e1) and e0 != e1 and order(0) == [e0, e1] and order(1)[0] != e0


def test_csv_keeps_text_as_written_and_reports_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "d.csv"
    p.write_text('q,a,note\n"1+6",007,x\n"2+2",4\n"multi\nline",5,y\n3+3,6,z,extra\n,1,w\n')
    with caplog.at_level(logging.WARNING):
        s = suite(p, extra=["note"], eval_fraction=0)
    assert [(t.prompt, t.answer) for t in s.train_tasks()] == [("1+6", "007"), ("multi\nline", "5")]
    assert "line 3: missing column 'note'" in caplog.text
    assert "line 6: more fields than the header's 3" in caplog.text and "line 7: empty prompt" in caplog.text


def test_parquet_streams_only_the_mapped_columns(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"q": f"{i}+1", "a": i + 1, "big": "x" * 100} for i in range(3000)] + [{"q": None, "a": 1, "big": ""}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=500)
    s = suite(tmp_path / "d.parquet", eval_fraction=0.1, eval_size=1000)
    assert len(s.train_tasks()) + len(s.eval_tasks()) == 3000 and s.counters["bad_rows"] == 1
    assert "big" not in s.train_tasks()[0].meta
    assert "row 3001: column 'q' (prompt) is a NoneType" in str(s.bad_rows[0])
    with pytest.raises(ValueError, match=r"d\.parquet has no usable row \(3001 bad: row 1: missing column 'answer'"):
        suite(tmp_path / "d.parquet", answer="answer")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"env\.params\.path: reading .*junk\.parquet as parquet failed"):
        suite(tmp_path / "junk.parquet")


def test_datasets_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:15]), "test": datasets.Dataset.from_list(ROWS[15:])})
    dd.save_to_disk(str(tmp_path / "ds"))
    s = suite(tmp_path / "ds", eval_path=str(tmp_path / "ds"), id="id")
    assert [t.id for t in s.train_tasks()] == [f"p{i}" for i in range(15)]
    assert [t.id for t in s.eval_tasks()] == [f"p{i}" for i in range(15, 20)]
    with pytest.raises(ValueError, match=r"holds splits \['test', 'train'\], not 'validation'"):
        suite(tmp_path / "ds", split="validation")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert len(suite(tmp_path / "one", eval_fraction=0.5).eval_tasks()) == 10


def test_params_are_validated_like_every_env(tmp_path: Path) -> None:
    p = jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(PluginError, match=r"env\.params\.promt: unknown key for env 'dataset'; did you mean `prompt`\? \[env\.params\] accepts: path, eval_path"):
        make_suite("dataset", {"path": str(p), "promt": "q"}, 0, 10)
    with pytest.raises(PluginError, match=r"env\.params\.eval_fraction: Expected `float` <= 1.0|env\.params\.eval_fraction: Expected `float` < 1.0"):
        make_suite("dataset", {"path": str(p), "eval_fraction": 1.5}, 0, 10)
    with pytest.raises(ValueError, match=r"env\.params\.template: \{level\} is neither \{prompt\} nor a column listed in env\.params\.extra"):
        suite(p, template="{level}: {prompt}")
    with pytest.raises(PluginError, match=r"env\.params\.reward: unknown reward 'exactly'"):
        suite(p, reward="exactly")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[env]\nname = "dataset"\n[env.params]\npath = "{p}"\nprompt = "q"\nanswer = "a"\nreward = "./nope.py:f"\n')
    r = CliRunner().invoke(app, ["validate", str(cfg)])
    assert r.exit_code == 2 and "env.params.reward: file './nope.py' not found" in r.output


REWARD = '''
def score(row, response):
    return {"reward": float(response == row["answer"]), "resp_len": len(response), "level": row["level"]}

def boom(row, response):
    raise RuntimeError("reward bug")
'''


async def test_env_step_scores_with_the_reward_and_failures_are_env_failures(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "rw.py").write_text(textwrap.dedent(REWARD))
    p = jsonl(tmp_path / "d.jsonl", ROWS)
    s = suite(p, extra=["level"], reward=f"{tmp_path}/rw.py:score", eval_fraction=0)
    env, t = s.make_env(), s.train_tasks()[4]
    assert await env.reset(t) == "4+4"
    res = await env.step("8")
    assert res.reward == 1.0 and res.done and res.info == {"metrics": {"resp_len": 1.0, "level": 1.0}}
    await s.aclose()
    s = suite(p, extra=["level"], reward=f"{tmp_path}/rw.py:boom")
    env = s.make_env()
    await env.reset(t)
    with caplog.at_level(logging.ERROR), pytest.raises(EnvFailure) as e:
        await env.step("8")
    assert e.value.reason == "reward_error" and "RuntimeError: reward bug" in str(e.value)
    assert "Traceback" in caplog.text and "rw.py" in caplog.text and "d.jsonl line 5" in caplog.text
    assert s.counters["reward_error"] == 1
    await s.aclose()


def cfg(**sections: Any) -> Config:
    return msgspec.convert(sections, Config)


async def test_controller_logs_reward_metrics_and_samples(tmp_path: Path) -> None:
    """Real event loop, fake engines: a user reward's extras become reward/<name> per step; samples are
    the batch's rollouts and the eval generations, readable."""
    (tmp_path / "rw.py").write_text(textwrap.dedent(REWARD))
    rows = [{"q": f"{i % 10}?", "a": str(i % 10), "level": i % 3} for i in range(40)]
    s = suite(jsonl(tmp_path / "d.jsonl", rows), extra=["level"], reward=f"{tmp_path}/rw.py:score", eval_fraction=0.1)
    c = cfg(run={"steps": 3, "eval_every": 2}, rollout={"group_size": 2, "batch_prompts": 2},
            log={"samples_per_step": 3, "eval_samples": 2})
    records: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    engines = [FakeEngine("e0", default_script(token_s=0.001))]
    ctl = Controller(c, FakeTokenizer(), s, engines, FakeTrainer(train_s=0.002), on_step=lambda r: records.append(r.to_dict()), on_samples=samples.extend)
    summary = await ctl.run()
    assert summary.steps == 3
    steps = [r for r in records if r["step"] > 0]
    assert all("reward/resp_len" in r and "reward/level" in r for r in steps)
    assert all(r["reward/resp_len"] >= 1 for r in steps)
    assert {"eval/reward/resp_len", "eval/accuracy"} <= set(records[0])
    train = [x for x in samples if x["kind"] == "train"]
    assert [x["step"] for x in train] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    x = train[0]
    assert x["prompt"].endswith("?") and x["response"] and x["policy_versions"] == [0]
    assert set(x) >= {"answer", "reward", "correct", "metrics", "finish_reason", "turns", "task_id", "sample_id"}
    assert x["metrics"]["resp_len"] == len(x["response"])
    evals = [x for x in samples if x["kind"] == "eval"]
    assert [x["step"] for x in evals] == [0, 0, 2, 2, 3, 3]
    assert evals[0]["task_id"] == evals[2]["task_id"]  # the same held-out tasks every time


async def test_a_raising_reward_is_retried_as_an_infrastructure_failure(tmp_path: Path) -> None:
    (tmp_path / "rw.py").write_text(textwrap.dedent(REWARD))
    s = suite(jsonl(tmp_path / "d.jsonl", ROWS), reward=f"{tmp_path}/rw.py:boom", eval_fraction=0)
    c = cfg(run={"steps": 1, "max_time_s": 5.0}, rollout={"group_size": 2, "batch_prompts": 1, "max_retries": 1})
    ctl = Controller(c, FakeTokenizer(), s, [FakeEngine("e0", default_script(token_s=0.001))], FakeTrainer())
    summary = await ctl.run()
    assert summary.steps == 0 and summary.stop_reason == "max_time"  # nothing scored 0 was ever trained
    n = summary.counters["rollout/retry_env_reward_error"]
    assert n > 0 and summary.counters["rollout/failed_env_reward_error"] > 0
    assert summary.counters["env/reward_error"] == n + summary.counters["rollout/failed_env_reward_error"]


def test_the_worked_example_validates_and_its_reward_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # paths in configs/dataset.toml are relative to the repository root
    r = CliRunner().invoke(app, ["validate", "configs/dataset.toml"])
    assert r.exit_code == 0, r.output
    from flashrl.config import load

    c = load("configs/dataset.toml")
    s = make_suite(c.env.name, c.env.params, c.run.seed, c.env.eval_size)
    assert len(s.train_tasks()) == 3600 and len(s.eval_tasks()) == 400 and s.counters == {}
    t = next(t for t in s.eval_tasks() if t.meta["carry"])
    assert t.prompt.endswith("=") and "+" in t.prompt
    fn = s.rewards.fn
    assert fn(s.row(t), t.answer) == {"reward": 1.0, "correct": True, "parsed": 1.0, "abs_error": 0.0, "carry_accuracy": 1.0}
    assert fn(s.row(t), "x") == {"reward": 0.0, "correct": False, "parsed": 0.0, "carry_accuracy": 0.0}

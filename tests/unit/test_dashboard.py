"""The dashboard shows what a user needs to read, with the right numbers, in every mode."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from flashrl.core.records import EvalStats, StepRecord
from flashrl.dashboard import Dashboard, choose_mode, format_duration, format_plain, render, sparkline
from flashrl.metrics import EngineStat, Snapshot


def make_snapshot(**overrides: object) -> Snapshot:
    base = dict(
        run_name="tiny-run",
        step=12,
        total_steps=60,
        version=12,
        elapsed_s=754.9,
        samples_per_s=12.34,
        tokens_per_s=456.7,
        engines=[
            EngineStat(name="engine-0", inflight=7, busy_fraction=0.83, tokens_per_s=230.4, version=12),
            EngineStat(name="engine-1", inflight=3, busy_fraction=0.41, tokens_per_s=118.0, version=11,
                       alive=False),
        ],
        pending_prompts=5,
        running_samples=14,
        buffered_groups=2,
        staleness_mean=0.75,
        staleness_max=2,
        reward_mean=0.41,
        weight_sync_s=0.123,
        step_s=1.5,
        reward_history=[(i, 0.05 + 0.03 * i) for i in range(1, 13)],
        eval_history=[(0, 0.125), (10, 0.375)],
        counters={"rollout/aborted_redundant": 3, "rollout/retry_env_timeout": 1,
                  "rollout/failed_env_error": 2, "dropped/groups_stale": 1, "admitted/groups": 40,
                  "engine/deaths": 0},
        status="training",
    )
    base.update(overrides)
    return Snapshot(**base)  # type: ignore[arg-type]


def render_text(s: Snapshot, width: int = 120) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render(s))
    return console.export_text()


def line_with(text: str, needle: str) -> str:
    lines = [ln for ln in text.splitlines() if needle in ln]
    assert len(lines) == 1, f"expected one line with {needle!r}, got {lines!r} in\n{text}"
    return lines[0]


def test_render_shows_header_numbers() -> None:
    text = render_text(make_snapshot())
    header = line_with(text, "tiny-run")
    assert "step 12/60" in header
    assert "policy v12" in header
    assert "elapsed 12:34" in header
    assert "12.3 samples/s" in header
    assert "457 tokens/s" in header


def test_render_engine_rows() -> None:
    text = render_text(make_snapshot())
    row0 = line_with(text, "engine-0").split()
    assert row0[1:7] == ["engine-0", "│", "7", "│", "83%", "│"]
    assert "230" in row0 and "v12" in row0 and "yes" in row0
    row1 = line_with(text, "engine-1")
    assert "41%" in row1 and "118" in row1 and "v11" in row1 and "DEAD" in row1
    assert "yes" not in row1


def test_render_queues_staleness_and_times() -> None:
    text = render_text(make_snapshot())
    assert line_with(text, "pending prompts").split()[-2] == "5"
    assert line_with(text, "running samples").split()[-2] == "14"
    assert line_with(text, "buffered groups").split()[-2] == "2"
    assert "0.75 / 2" in line_with(text, "staleness mean/max")
    assert "1.50s" in line_with(text, "step time")
    assert "0.12s" in line_with(text, "weight sync")
    assert "train/infer KL" not in text  # not measured yet
    assert "4.0e-09" in line_with(render_text(make_snapshot(mismatch_kl=4e-9)), "train/infer KL")
    assert "lr " not in text  # no step trained yet
    assert "5.87e-05" in line_with(render_text(make_snapshot(lr=5.87e-5)), "lr ")


def test_render_shows_the_last_batch_lineage() -> None:
    text = render_text(make_snapshot(trained_tokens=4096, trained_len_mean=128.0, dropped_samples=3, dropped_tokens=900,
                                     updates_spanned_mean=0.25, interrupted_frac=0.125))
    assert "4096 / 128.0" in line_with(text, "trained tokens / length")
    assert "3 / 900" in line_with(text, "dropped samples / tokens")
    assert "0.25 / 12%" in line_with(text, "updates spanned / interrupted")


def test_render_shows_what_evals_cost() -> None:
    """Evals so far, their time, and what they stalled: the train loop (and its share of the run), generation."""
    text = render_text(make_snapshot(eval_s=1.25, eval_trainer_wait_s=0.5, eval_gen_wait_s=0.25, eval_running=True))
    assert "2 in 1.2s running" in line_with(text, "evals")
    share = 0.5 / make_snapshot().elapsed_s
    assert f"0.50s ({share:.1%})" in line_with(text, "eval: trainer wait")
    assert "0.25s" in line_with(text, "eval: gen idle")
    assert "eval:" not in render_text(make_snapshot(eval_history=[]))  # no eval yet: no rows


def test_render_learning_curves_show_latest_and_first() -> None:
    text = render_text(make_snapshot())
    reward = line_with(text, "reward ")
    assert "0.410 @12" in reward and "(first 0.080 @1)" in reward
    # a rising reward reads as a rising sparkline, lowest bar first, highest last
    spark = sparkline([0.05 + 0.03 * i for i in range(1, 13)])
    assert spark in reward and spark[0] == "▁" and spark[-1] == "█"
    acc = line_with(text, "held-out acc")
    assert "0.375 @10" in acc and "(first 0.125 @0)" in acc


def test_render_counters_and_status() -> None:
    text = render_text(make_snapshot())
    lines = text.splitlines()
    first = lines.index(line_with(text, "counters"))
    # grouped by prefix, one line per group, sorted; zeros shown too
    assert [ln.split() for ln in lines[first:first + 4]] == [
        ["counters", "admitted:", "groups=40"],
        ["dropped:", "groups_stale=1"],
        ["engine:", "deaths=0"],
        ["rollout:", "aborted_redundant=3", "failed_env_error=2", "retry_env_timeout=1"],
    ]
    assert line_with(text, "status").split() == ["status", "training"]


def test_render_before_anything_happened() -> None:
    text = render_text(Snapshot())
    assert "step 0" in text and "(no engines yet)" in text
    assert line_with(text, "counters").split() == ["counters", "none"]
    assert line_with(text, "held-out acc").split() == ["│", "held-out", "acc", "-", "│"]
    assert line_with(text, "status").split() == ["status", "starting"]


def test_render_without_step_limit_shows_bare_step() -> None:
    text = render_text(make_snapshot(total_steps=0))
    assert "step 12 " in line_with(text, "tiny-run") and "12/" not in text


def test_sparkline_scaling_and_downsampling() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([3, 3, 3]) == "▄▄▄"
    assert sparkline([0, float("nan"), 1]) == "▁ █"
    assert sparkline([]) == ""
    # 100 values into 10 bars: bucket means, still monotone, exactly 10 wide
    s = sparkline(list(range(100)), width=10)
    assert len(s) == 10 and s[0] == "▁" and s[-1] == "█" and list(s) == sorted(s)
    with pytest.raises(ValueError, match="width must be >= 1"):
        sparkline([1.0], width=0)


def test_format_duration() -> None:
    assert format_duration(0) == "0:00"
    assert format_duration(754.9) == "12:34"
    assert format_duration(3 * 3600 + 5 * 60 + 7) == "3:05:07"


def test_plain_line_exact() -> None:
    assert format_plain(make_snapshot()) == (
        "step 12/60 v12 reward 0.41 acc 0.38 stale 0.8/2 12.3 samples/s 457 tok/s step 1.50s sync 0.12s "
        "dropped/groups_stale=1 rollout/aborted_redundant=3 rollout/failed_env_error=2 "
        "rollout/retry_env_timeout=1"
    )
    assert format_plain(make_snapshot(eval_history=[], counters={"failed/x": 0}, total_steps=0)) == (
        "step 12 v12 reward 0.41 acc - stale 0.8/2 12.3 samples/s 457 tok/s step 1.50s sync 0.12s"
    )
    assert format_plain(make_snapshot(counters={}, mismatch_kl=3.2e-7)).endswith("sync 0.12s mismatch 3.2e-07")
    assert format_plain(make_snapshot(counters={}, lr=5.87e-5)).endswith("sync 0.12s lr 5.9e-05")


def test_plain_dashboard_prints_one_line_per_new_step() -> None:
    out = io.StringIO()
    dash = Dashboard("plain", Console(file=out, width=80))
    dash.start()
    dash.update(make_snapshot(step=0))  # nothing trained yet: no line
    dash.update(make_snapshot(step=1, total_steps=3))
    dash.update(make_snapshot(step=1, total_steps=3, running_samples=99))  # same step: no new line
    dash.update(make_snapshot(step=2, total_steps=3))
    dash.update(make_snapshot(step=3, total_steps=3, status="done", elapsed_s=61))
    dash.stop()
    dash.stop()  # idempotent
    lines = out.getvalue().splitlines()
    assert [ln.split(" v12")[0] for ln in lines[:3]] == ["step 1/3", "step 2/3", "step 3/3"]
    assert lines[3] == "status done after 1:01"
    assert len(lines) == 4
    # lines are never wrapped at the console width, so a log grep sees a whole record
    assert len(lines[0]) > 80


def test_plain_stop_prints_last_unprinted_step_and_failure_status() -> None:
    out = io.StringIO()
    dash = Dashboard("plain", Console(file=out, width=200))
    dash.update(make_snapshot(step=4, total_steps=60))
    dash.update(make_snapshot(step=4, status="failed: engine-1 died"))
    dash.stop()
    assert out.getvalue().splitlines()[-1] == "status failed: engine-1 died after 12:34"


def test_off_mode_prints_nothing() -> None:
    out = io.StringIO()
    with Dashboard("off", Console(file=out)) as dash:
        dash.update(make_snapshot())
    assert out.getvalue() == ""


def test_rich_dashboard_draws_final_view() -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True, color_system=None)
    dash = Dashboard("rich", console)
    dash.start()
    dash.update(make_snapshot(step=59))
    dash.update(make_snapshot(step=60, status="done"))
    dash.stop()
    # the final frame (after the last header) is the last snapshot, and stop() restored the cursor
    final = out.getvalue().rsplit("tiny-run", 1)[1]
    assert final.startswith("   step 60/60 ")
    assert "status    done\n" in final
    assert out.getvalue().endswith("\x1b[?25h")


def test_choose_mode() -> None:
    tty = Console(file=io.StringIO(), force_terminal=True)
    pipe = Console(file=io.StringIO(), force_terminal=False)
    assert choose_mode("auto", tty) == "rich"
    assert choose_mode("auto", pipe) == "plain"
    assert choose_mode("rich", pipe) == "rich"  # an explicit choice wins
    assert choose_mode("plain", tty) == "plain"
    assert choose_mode("off", tty) == "off"
    with pytest.raises(ValueError, match="run.dashboard must be one of auto, rich, plain, off; got 'fancy'"):
        choose_mode("fancy", tty)
    with pytest.raises(ValueError, match="see choose_mode"):
        Dashboard("auto")  # type: ignore[arg-type]


def test_status_messages_before_the_controller_exists() -> None:
    out = io.StringIO()
    dash = Dashboard.for_config("auto", Console(file=out, width=120))  # not a terminal: plain
    assert dash.mode == "plain"
    dash.start()
    dash.status("preparing model builtin:tiny")
    dash.status("starting 2 engine(s) and 1 trainer rank(s)")
    dash.stop()  # failed before any snapshot: no made-up final line
    assert out.getvalue().splitlines() == [
        "status preparing model builtin:tiny",
        "status starting 2 engine(s) and 1 trainer rank(s)",
    ]


def test_rich_status_and_step_record() -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True, color_system=None)
    dash = Dashboard.for_config("auto", console)
    assert dash.mode == "rich"
    dash.start()
    dash.status("joining the weight-sync group")
    rec = StepRecord(step=1, version=1, eval=EvalStats(accuracy=0.5, reward_mean=0.5))
    dash.step(rec)
    assert dash.last_record is rec
    dash.stop()
    assert "status    joining the weight-sync group\n" in out.getvalue()


def test_run_summary_line_says_what_evals_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """`flashrl run`'s last line: the evals' time, what the trainer waited for them (share of training), idle generation."""
    from flashrl.launch.driver import _print_summary

    s = {"run": "tiny", "steps": 100, "wall_s": 40.0, "peak_mem_gib": 2.0, "evals": [(0, 0.5), (100, 0.9)],
         "checkpoints": 0, "checkpoint_s": 0.0, "checkpoint_share": 0.0, "eval_wait_share": 0.0125,
         "result": {"eval_s": 8.1, "eval_trainer_wait_s": 0.25, "eval_gen_wait_s": 0.5, "counters": {}}}
    _print_summary(s)
    out = capsys.readouterr().out
    assert "evals 8.1s, trainer waited 0.2s for them (1.2% of training time), generation idle 0.5s" in out


def test_problem_counters_on_the_plain_line_are_problems() -> None:
    """Lost, repeated or failed work is a problem counter; a latency or a chat template's counters are not (the
    judge's mean latency once showed among the failures because "latency" holds "late")."""
    from flashrl.dashboard import is_problem_counter

    for name in ("buffer/late_samples", "rollout/failed_env_error", "engine/restarts", "rollout/retry_timeout",
                 "dropped/stale_samples", "env/judge_engine_timeout", "weight_sync/skipped_versions"):
        assert is_problem_counter(name), name
    for name in ("env/judge_latency_ms", "env/rm_latency_ms", "template/mismatch_tokens", "groups/admitted"):
        assert not is_problem_counter(name), name

"""The chaos report's bookkeeping (flashrl/bench/chaos_report.py) on hand-made records: it must catch a
repeated prompt, a lost one, a broken step sequence, and price failures as documented."""

from __future__ import annotations

from typing import Any

from flashrl.bench import chaos_report


def _rows(batches: list[list[int]], acc: tuple[float, float] = (0.5, 0.8)) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"step": 0, "eval/accuracy": acc[0]}]
    for i, b in enumerate(batches, start=1):
        rows.append({"step": i, "prompt_uids": b})
    rows[-1]["eval/accuracy"] = acc[1]
    return rows


def _state(next_uid: int, readmit: list[int], dropped: list[int] | None = None, train_size: int = 6,
           counters: dict[str, int] | None = None) -> dict[str, Any]:
    d = dropped or []
    return {"next_uid": next_uid, "readmit": readmit, "dropped_uids": d, "train_size": train_size,
            "counters": counters if counters is not None else ({"dropped/groups_unfillable": len(d)} if d else {})}


def test_every_prompt_accounted_for_across_epochs() -> None:
    # async: steps train out of order; uids 0..11 = two epochs of 6; 12, 13 outstanding; 9 dropped
    rows = _rows([[1, 0], [3, 2], [5, 4], [7, 6], [10, 8], [11]])
    v = chaos_report.verify_prompts(rows, _state(14, [12, 13], [9]))
    assert v["ok"] and v["repeated"] == [] and v["lost"] == []
    assert v["trained_prompts"] == 11 and v["handed_out"] == 14 and v["dropped"] == 1
    assert [(e["epoch"], e["complete"], e["trained"], e["dropped"], e["outstanding"]) for e in v["epochs"]] == [
        (0, True, 6, 0, 0), (1, True, 5, 1, 0), (2, False, 0, 0, 2)]


def test_groups_saved_with_their_rollouts_are_outstanding() -> None:
    """Partial mode: the final checkpoint names the groups it saved with their rollouts (rollout_groups), not
    in readmit; they are outstanding, neither lost nor allowed to have been trained."""
    rows = _rows([[1, 0], [3, 2], [5, 4]])
    state = {**_state(9, [6]), "rollout_groups": [7, 8]}
    v = chaos_report.verify_prompts(rows, state)
    assert v["ok"] and v["lost"] == [] and v["outstanding_at_end"] == 3
    assert not chaos_report.verify_prompts(rows, _state(9, [6]))["ok"]  # without them: 7, 8 lost
    v = chaos_report.verify_prompts(_rows([[1, 0], [3, 2], [5, 4], [7]]), state)
    assert not v["ok"] and v["trained_and_outstanding"] == [7]


def test_a_repeated_prompt_fails() -> None:
    v = chaos_report.verify_prompts(_rows([[0, 1], [2, 1]]), _state(3, []))
    assert not v["ok"] and v["repeated"] == [{"uid": 1, "first_step": 1, "again_step": 2}]


def test_a_lost_prompt_fails() -> None:
    # uid 2 was handed out, is neither trained nor outstanding nor dropped
    v = chaos_report.verify_prompts(_rows([[0, 1], [3, 4]]), _state(6, [5]))
    assert not v["ok"] and v["lost"] == [2]
    # ... also when it is outstanding at the end AND trained (counted twice)
    v = chaos_report.verify_prompts(_rows([[0, 1], [2, 3]]), _state(5, [3, 4]))
    assert not v["ok"] and v["trained_and_outstanding"] == [3]
    # an uncounted drop: the uid list says dropped but no counter does
    v = chaos_report.verify_prompts(_rows([[0, 1]]), _state(3, [], [2], counters={}))
    assert not v["ok"]


def test_drops_known_only_by_count() -> None:
    # an old checkpoint without dropped_uids: the unaccounted uids must match the counted drops exactly
    st = _state(4, [], counters={"dropped/groups_unfillable": 1})
    assert chaos_report.verify_prompts(_rows([[0, 1], [3]]), st)["ok"]
    assert not chaos_report.verify_prompts(_rows([[0], [3]]), st)["ok"]  # two missing, one counted


def test_steps_and_accuracy() -> None:
    rows = _rows([[0], [1], [2]], acc=(0.51, 0.78))
    assert chaos_report.steps_contiguous(rows)
    assert not chaos_report.steps_contiguous(rows[:2] + rows[3:])
    assert not chaos_report.steps_contiguous(rows + [rows[-1]])
    a = chaos_report.accuracy(rows)
    assert a["start"] == 0.51 and a["end"] == 0.78 and a["gain_points"] == 27.0


def test_engine_failure_cost_against_the_all_up_rate() -> None:
    # segment 1 from t=0 to t=100, 1 step/s while all up; engine0 down 20..40 with 10 steps made meanwhile
    times = [float(t) for t in range(0, 20)] + [20 + 2.0 * k for k in range(10)] + [float(t) for t in range(40, 100)]
    step_times = [(t, i + 1, 1) for i, t in enumerate(times)]
    ev = [{"kind": "engine_kill", "segment": 1, "target": "engine0", "t": 20.0, "step": 20, "back_t": 40.0}]
    c = chaos_report.engine_failure_costs(ev, step_times, [{"segment": 1, "first_step_t": 0.0, "end_t": 100.0}])
    assert c["step_rate_all_up"] == {"1": 1.0}
    k = c["kills"][0]
    assert k["down_s"] == 20.0 and k["steps_while_down"] == 10 and k["lost_s"] == 10.0
    assert c["not_back"] == []
    ev[0]["back_t"] = None  # never back: a failure, unless the run ended soon after the kill
    c = chaos_report.engine_failure_costs(ev, step_times, [{"segment": 1, "first_step_t": 0.0, "end_t": 100.0}])
    assert c["not_back"] == [] and c["run_ended_while_restarting"] == ["engine0"]
    c = chaos_report.engine_failure_costs(ev, step_times, [{"segment": 1, "first_step_t": 0.0, "end_t": 20.0 + chaos_report.BACK_WITHIN_S}])
    assert c["not_back"] == ["engine0"] and c["run_ended_while_restarting"] == []


def test_controller_failure_cost() -> None:
    # killed at t=100 at step 50; checkpoint at 40; relaunched at 130; step 41 at 160, step 50 again at 175
    step_times = [(float(t), t, 1) for t in range(1, 101) if t <= 50] + [(160.0 + (s - 41) * (15 / 9), s, 2) for s in range(41, 60)]
    ev = {"kind": "controller_kill", "segment": 1, "t": 100.0, "step": 50, "relaunch_t": 130.0}
    c = chaos_report.controller_failure_cost(ev, step_times, 40)
    assert c["steps_redone"] == 10 and c["relaunch_to_first_new_step_s"] == 30.0 and c["kill_to_first_new_step_s"] == 60.0
    assert c["lost_s"] == 75.0


def test_counted_per_segment_and_checkpoint_times() -> None:
    rows = [{"step": 0}, {"step": 1, "count/engine/deaths": 1}, {"step": 2, "count/engine/deaths": 2},
            {"step": 3, "count/engine/deaths": 4}]
    assert chaos_report.counted(rows, ["engine/deaths"]) == {"engine/deaths": 4}
    assert chaos_report.counted(rows, ["engine/deaths"], since_step=2) == {"engine/deaths": 2}
    log = ("x checkpoint runs/a/checkpoints/step-50 written in 0.52 s\n"
           "y checkpoint runs/a/checkpoints/step-100 written in 1.25 s\n")
    assert chaos_report.checkpoint_times([log]) == [0.52, 1.25]


def test_analyze_pass_and_fail() -> None:
    rows = _rows([[0, 1], [2, 3]], acc=(0.5, 0.75))
    for r in rows[1:]:
        r["count/engine/deaths"] = 1
        r["count/weight_sync/engine_died"] = 1
    ev = [{"kind": "engine_kill_in_sync", "segment": 1, "target": "engine1", "t": 5.0, "step": 1, "back_t": 9.0},
          {"kind": "controller_kill", "segment": 1, "target": "flashrl run", "t": 10.0, "step": 1,
           "survivors_after_30s": 0, "relaunch_t": 40.0}]
    kw: dict[str, Any] = dict(rows=rows, seg1_rows=rows[:2], final_state=_state(5, [4]), events=ev,
                              step_times=[(1.0, 1, 1), (50.0, 2, 2)],
                              segments=[{"segment": 1, "first_step_t": 1.0, "end_t": 10.0},
                                        {"segment": 2, "first_step_t": 50.0, "end_t": 60.0}],
                              logs=["checkpoint p written in 0.5 s"], summary={"result": {"elapsed_s": 50.0}},
                              resumed_from=1, exit_code=0)
    rep = chaos_report.analyze(**kw)
    assert rep["pass"], rep["checks"]
    assert rep["checkpoints"]["share_of_training"] == 0.01
    assert "PASS" in chaos_report.markdown(rep, "flashrl bench chaos")
    rep = chaos_report.analyze(**{**kw, "rows": _rows([[0, 1], [2, 3]], acc=(0.5, 0.6))})
    assert not rep["pass"] and not rep["checks"]["gain_ge_20_points"]
    ev[1]["survivors_after_30s"] = 2
    assert not chaos_report.analyze(**kw)["checks"]["no_process_outlived_the_controller"]
    ev[1]["survivors_after_30s"] = 0
    assert not chaos_report.analyze(**{**kw, "exit_code": 130})["checks"]["exit_ok"]
    assert chaos_report.analyze(**{**kw, "exit_code": 130, "stopped_by_bench": True})["checks"]["exit_ok"]

"""On-policy distillation for real: `flashrl run` with a teacher on a vLLM engine process of its own.

- The reverse KL the run trains on equals an independent computation: transformers forwards of the student that
  generated the batch (version 0: the model folder the run starts from; a synchronous run, so the whole first batch
  is that version's) and of the teacher, on the tokens samples.jsonl saved, within 1e-4, per token and as the
  step's distill/reverse_kl.
- The teacher's engine SIGKILLed mid-run: every step once, the death named, the retries and the restart counted,
  no sample failed for it, nothing left running.
- Two teachers, a data column naming each prompt's: every sample scored by the engines of the teacher its row names.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flashrl.metrics import read_jsonl
from tests.helpers import engine_processes, killed_on_exit, wait_while_running

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _cmd(tmp_path: Path, name: str, teacher: Path, steps: int, *more: str) -> list[str]:
    sets = [f"run.output_dir={tmp_path}", f"run.name={name}", f"run.steps={steps}", "run.max_time_s=0",
            "run.eval_every=0", "run.dashboard=plain", "run.checkpoint_every=0",
            f'distill.teachers=[{{name = "exact", model = "{teacher}", kv_cache_gib = 0.25, top_k = 12}}]', *more]
    return [sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "distill.toml"),
            *[x for s in sets for x in ("--set", s)]]


def _teacher(tmp_path: Path) -> Path:
    from flashrl.models.tiny import build_untrained

    return build_untrained(tmp_path / "teacher", seed=3)  # the built-in's tokenizer: the student's vocabulary


def _logprobs(folder: Path, prompt: list[int], response: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = model(input_ids=ids).logits[0].log_softmax(-1)
    return [float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(response)]


@pytest.mark.timeout(900)
def test_the_runs_reverse_kl_equals_an_independent_computation(tmp_path: Path) -> None:
    from flashrl.config import load
    from flashrl.models import ensure_model
    from flashrl.models.tokenizer import load_tokenizer

    teacher = _teacher(tmp_path)
    cmd = _cmd(tmp_path, "kl", teacher, 1, "scheduler.async_ratio=0", "log.samples_per_step=128")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    student = ensure_model(load(ROOT / "configs" / "distill.toml"))
    tok = load_tokenizer(student)
    lines = [r for r in read_jsonl(tmp_path / "kl" / "samples.jsonl") if r["kind"] == "train"]
    assert len(lines) == 128 and all(r["policy_versions"] == [0] and r["teacher"] == "exact" for r in lines)
    diffs: list[float] = []
    for r in lines[:24]:  # a transformers forward each: two dozen samples, every token
        prompt = tok.encode(r["prompt"])
        s_lp, t_lp = _logprobs(student, prompt, r["response_ids"]), _logprobs(teacher, prompt, r["response_ids"])
        assert max(abs(a - b) for a, b in zip(s_lp, r["behav_logp"])) < 1e-4
        assert max(abs(a - b) for a, b in zip(t_lp, r["teacher_logp"])) < 1e-4
        diffs += [a - b for a, b in zip(s_lp, t_lp)]
    run_kl = sum(b - t for r in lines for b, t in zip(r["behav_logp"], r["teacher_logp"]))
    n = sum(len(r["behav_logp"]) for r in lines)
    (row,) = [m for m in read_jsonl(tmp_path / "kl" / "metrics.jsonl") if "distill/reverse_kl" in m]
    assert abs(row["distill/reverse_kl"] - run_kl / n) < 1e-4  # the trainer's, over the batch it trained
    assert abs(row["rollout/teacher_reverse_kl"] - run_kl / n) < 1e-4
    assert diffs and all(abs(d) < 50 for d in diffs)


@pytest.mark.timeout(1200)
def test_a_killed_teacher_engine_is_restarted_and_every_step_trains_once(tmp_path: Path) -> None:
    steps = 12
    out_file = (tmp_path / "out.txt").open("wb")
    proc = subprocess.Popen(_cmd(tmp_path, "tkill", _teacher(tmp_path), steps, "rollout.turn_timeout_s=300"),
                            cwd=ROOT, stdout=out_file, stderr=subprocess.STDOUT, start_new_session=True)
    metrics = tmp_path / "tkill" / "metrics.jsonl"
    seen: list[psutil.Process] = []
    with killed_on_exit(proc):
        wait_while_running("training step 2", lambda: metrics.exists() and any(r.get("step", 0) >= 2 for r in read_jsonl(metrics)),
              proc, 900)
        first = wait_while_running("the teacher engine", lambda: engine_processes(proc.pid, "teacher-exact-0"), proc, 30)[0]
        seen += psutil.Process(proc.pid).children(recursive=True)
        first.send_signal(signal.SIGSTOP)  # stopped, so the kill lands with scoring requests in flight
        time.sleep(1.0)
        os.killpg(first.pid, signal.SIGKILL)
        second = wait_while_running("a restarted teacher engine",
                       lambda: [p for p in engine_processes(proc.pid, "teacher-exact-0") if p.pid != first.pid], proc, 300)[0]
        seen.append(second)
        proc.wait(timeout=900)
    out_file.close()
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 0, out[-3000:]
    rows = [r for r in read_jsonl(metrics) if r.get("step", 0) >= 1]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once
    last = rows[-1]
    assert last["env/teacher_exact_engine_died"] == 1 and last["env/teacher_exact_engine_restarts"] == 1, last
    assert last["env/teacher_retries"] >= 1 and last["env/teacher_exact_engines_started"] == 2, last
    assert last.get("env/teacher_failed", 0) == 0 and not any(k.startswith("count/rollout/failed_teacher") for k in last)
    assert all(r["distill/reverse_kl"] != 0 for r in rows)  # every step trained on its teacher's scores
    log = (tmp_path / "tkill" / "logs" / "controller.log").read_text()
    assert f"teacher exact engine 0 (pid {first.pid}) died (exit code -9)" in log
    time.sleep(0.5)
    alive = [c for c in seen if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"left running: {[(c.pid, c.cmdline()) for c in alive]}"


@pytest.mark.timeout(900)
def test_each_prompt_is_scored_by_the_teacher_its_row_names(tmp_path: Path) -> None:
    """Two teachers on engines of their own; a data column (env.params.extra) picks each prompt's. Every sample's
    teacher log-probabilities are its named teacher's (a transformers forward), not the other's."""
    import textwrap

    from flashrl.config import load
    from flashrl.models import ensure_model
    from flashrl.models.tiny import build_untrained
    from flashrl.models.tokenizer import load_tokenizer

    student = ensure_model(load(ROOT / "configs" / "tiny.toml")).resolve()
    folders = {"a": build_untrained(tmp_path / "ta", seed=3), "b": build_untrained(tmp_path / "tb", seed=4)}
    picks = {f"{i}+{i + 7}=": "ab"[i % 3 == 0] for i in range(40)}  # the rendered prompt -> its row's teacher
    (tmp_path / "rows.jsonl").write_text("".join(
        f'{{"q": "{i}+{i + 7}", "a": "{2 * i + 7}", "who": "{"ab"[i % 3 == 0]}"}}\n' for i in range(40)))
    teachers = "".join(f'\n        [[distill.teachers]]\n        name = "{n}"\n        model = "{f}"\n'
                       "        kv_cache_gib = 0.25\n        threads = 1" for n, f in folders.items())
    (tmp_path / "run.toml").write_text(textwrap.dedent(f"""
        [run]
        name = "two"
        output_dir = "{tmp_path}"
        steps = 1
        eval_every = 0
        dashboard = "plain"
        checkpoint_every = 0
        [model]
        path = "{student}"
        max_model_len = 64
        [env]
        name = "dataset"
        eval_size = 4
        [env.params]
        path = "{tmp_path / 'rows.jsonl'}"
        prompt = "q"
        answer = "a"
        extra = ["who"]
        template = "{{prompt}}="
        [distill]
        mode = "kl"
        teacher_key = "who"{teachers}
        [rollout]
        group_size = 4
        batch_prompts = 8
        max_new_tokens = 4
        temperature = 1.0
        [scheduler]
        async_ratio = 0
        [engine]
        count = 1
        kv_cache_gib = 0.25
        threads = 1
        [log]
        samples_per_step = 32
    """))
    done = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(tmp_path / "run.toml")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    tok = load_tokenizer(student)
    lines = [r for r in read_jsonl(tmp_path / "two" / "samples.jsonl") if r["kind"] == "train"]
    assert len(lines) == 32 and {r["teacher"] for r in lines} == {"a", "b"}
    checked = {"a": 0, "b": 0}
    for r in lines:
        named = picks[r["prompt"]]
        assert r["teacher"] == named, (r["prompt"], r["teacher"])
        if checked[named] >= 4:
            continue
        checked[named] += 1
        prompt = tok.encode(r["prompt"])
        own = _logprobs(folders[named], prompt, r["response_ids"])
        other = _logprobs(folders["ab"[named == "a"]], prompt, r["response_ids"])
        assert max(abs(x - y) for x, y in zip(own, r["teacher_logp"])) < 1e-4
        assert max(abs(x - y) for x, y in zip(other, r["teacher_logp"])) > 1e-2  # the teachers do differ
    assert checked == {"a": 4, "b": 4}

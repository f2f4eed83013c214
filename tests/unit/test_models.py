"""The built-in model: char tokenizer, untrained build (transformers loads it), ensure_model cache."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from flashrl.config import Config, EnvConfig, ModelConfig, RunConfig
from flashrl.models import ModelPathError, TinySpec, WarmStart, build_untrained, ensure_model, load_tokenizer
from flashrl.models.tokenizer import CHARSET, build_char_tokenizer

# Smallest shape vLLM's CPU attention accepts (head size 32) and a warm-start of a few steps.
SMALL = TinySpec(layers=1, hidden=32, heads=1, kv_heads=1, intermediate=64, max_position=64)
QUICK = WarmStart(max_steps=4, batch=8, check_every=2, probe_size=8, target_accuracy=1.0)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_untrained(tmp_path_factory.mktemp("tiny") / "m", seed=0, spec=SMALL)


def test_tokenizer_round_trip(untrained: Path) -> None:
    tok = load_tokenizer(untrained)
    text = CHARSET + " 12+34=46\n(a, b): 'x' \"y\" #1 & 2% done?!"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, no BOS/EOS added
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 2)
    assert tok.decode(tok.encode("46") + [tok.eos_token_id, tok.pad_token_id]) == "46"  # specials skipped
    assert tok.encode("7") == [build_char_tokenizer().convert_tokens_to_ids("7")]


def test_tokenizer_file_reads_as_transformers_does(untrained: Path) -> None:
    import random

    from transformers import AutoTokenizer

    from flashrl.models.tokenizer import HFTokenizer

    fast, hf = load_tokenizer(untrained), AutoTokenizer.from_pretrained(str(untrained), local_files_only=True)
    ref = HFTokenizer(hf)
    assert type(fast.hf).__name__ == "TokenizerFile"
    assert (fast.vocab_size, fast.eos_token_id, fast.pad_token_id) == (ref.vocab_size, ref.eos_token_id, ref.pad_token_id)
    rng = random.Random(0)
    for i in range(300):  # characters outside CHARSET (unk), special tokens written in the text, ids of specials
        text = "".join(rng.choice(CHARSET + "\t\u00e9\u20ac<>") for _ in range(rng.randint(0, 24)))
        text = text + "<eos>" + text if i % 5 == 0 else text
        assert fast.encode(text) == ref.encode(text), text
        ids = [rng.randrange(ref.vocab_size) for _ in range(rng.randint(0, 16))]
        assert fast.decode(ids) == ref.decode(ids), ids
        # .hf itself, with transformers' defaults (special tokens added / kept): it stands in for transformers'
        assert fast.hf.encode(text) == hf.encode(text) and fast.hf.decode(ids) == hf.decode(ids), (text, ids)


def test_tokenizer_file_only_where_transformers_adds_nothing(tmp_path: Path, untrained: Path) -> None:
    import shutil

    def variant(name: str, **extra: object) -> Path:
        d = tmp_path / name
        shutil.copytree(untrained, d)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **extra}))
        return d

    assert type(load_tokenizer(variant("plain")).hf).__name__ == "TokenizerFile"
    # A chat template, or an option transformers applies to the tokenizer: transformers loads it.
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert type(load_tokenizer(variant("chat", chat_template=template)).hf).__name__ != "TokenizerFile"
    assert load_tokenizer(variant("chat2", chat_template=template)).chat is not None
    assert type(load_tokenizer(variant("prefix", add_prefix_space=True)).hf).__name__ != "TokenizerFile"
    # A special token tokenizer.json lacks (transformers adds it): transformers too.
    assert type(load_tokenizer(variant("neweos", eos_token="<end>")).hf).__name__ != "TokenizerFile"


def test_untrained_loads_in_transformers(untrained: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(untrained))
    assert model.dtype == torch.float32
    hf_tok = AutoTokenizer.from_pretrained(str(untrained))
    # AutoTokenizer (what vLLM uses) must honour our tokenizer.json: spaces and newlines survive.
    assert hf_tok.decode(hf_tok.encode("a b\nc", add_special_tokens=False)) == "a b\nc"
    assert hf_tok.encode("1+2=", add_special_tokens=True) == hf_tok.encode("1+2=", add_special_tokens=False)
    assert model.config.vocab_size == len(hf_tok)
    gen = json.loads((untrained / "generation_config.json").read_text())
    assert gen["eos_token_id"] == hf_tok.eos_token_id == 2
    logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, len(hf_tok))


def test_untrained_is_seeded(tmp_path: Path, untrained: Path) -> None:
    from safetensors.torch import load_file

    same = load_file(build_untrained(tmp_path / "a", seed=0, spec=SMALL) / "model.safetensors")
    other = load_file(build_untrained(tmp_path / "b", seed=1, spec=SMALL) / "model.safetensors")
    ref = load_file(untrained / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert (same[name] == ref[name]).all()
    assert not (other[name] == ref[name]).all()


def test_spec_rejects_head_size_vllm_cpu_lacks() -> None:
    with pytest.raises(ValueError, match="head size"):
        TinySpec(hidden=48, heads=1, kv_heads=1)
    with pytest.raises(ValueError, match="kv_heads"):
        TinySpec(hidden=128, heads=4, kv_heads=3)


def _cfg(cache: Path, seed: int = 0) -> Config:
    return Config(
        run=RunConfig(seed=seed),
        model=ModelConfig(cache_dir=str(cache)),
        env=EnvConfig(name="arithmetic", params={"digits": 1, "train_size": 50}, eval_size=10),
    )


def test_ensure_model_builds_once_and_caches(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flashrl.models")
    paths: list[Path] = []
    # Two concurrent callers: the file lock lets exactly one build.
    threads = [threading.Thread(target=lambda: paths.append(ensure_model(_cfg(tmp_path), SMALL, QUICK))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 2 and paths[0] == paths[1]
    path = paths[0]
    assert sum("building" in r.getMessage() for r in caplog.records) == 1
    report = json.loads((path / "flashrl_warmstart.json").read_text())
    assert report["steps"] == 4 and report["seconds"] > 0
    # the report states the saved model's greedy accuracy on the held-out split: recompute it
    from transformers import AutoModelForCausalLM

    from envs import make_suite
    from flashrl.models.tiny import answer_tokens, greedy_accuracy

    suite = make_suite("arithmetic", {"digits": 1, "train_size": 50}, 0, 10)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    max_new = answer_tokens(list(suite.train_tasks()) + list(suite.eval_tasks()))
    assert report["eval_accuracy"] == greedy_accuracy(model, load_tokenizer(path), list(suite.eval_tasks()), max_new)
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".build-*"))  # the temp build folder was renamed into place

    mtime = (path / "model.safetensors").stat().st_mtime_ns
    caplog.clear()
    assert ensure_model(_cfg(tmp_path), SMALL, QUICK) == path
    assert not any("building" in r.getMessage() for r in caplog.records)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime

    # Anything in the key (here the seed, or the warm-start) gives another model.
    assert ensure_model(_cfg(tmp_path, seed=1), SMALL, QUICK) != path
    assert ensure_model(_cfg(tmp_path), SMALL, WarmStart(max_steps=2, batch=8, check_every=2, probe_size=8)) != path


def test_ensure_model_is_deterministic(tmp_path: Path) -> None:
    a = ensure_model(_cfg(tmp_path / "a"), SMALL, QUICK)
    b = ensure_model(_cfg(tmp_path / "b"), SMALL, QUICK)
    assert a.name == b.name  # same key
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_ensure_model_other_path(tmp_path: Path, untrained: Path) -> None:
    cfg = Config(model=ModelConfig(path=str(untrained)))
    assert ensure_model(cfg) == untrained
    missing = tmp_path / "nope"
    with pytest.raises(ModelPathError, match=r"model\.path: .*nope.* does not exist.*builtin:tiny"):
        ensure_model(Config(model=ModelConfig(path=str(missing))))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match="holds no config.json"):
        ensure_model(Config(model=ModelConfig(path=str(tmp_path / "empty"))))


def test_teacher_answers_slip_only_carries_and_are_seeded() -> None:
    import random

    from flashrl.env import Task
    from flashrl.models.tiny import teacher_answers

    tasks = [Task(id="c", prompt="17+25=", answer="42"), Task(id="n", prompt="14+25=", answer="39"),
             Task(id="m", prompt="17*25=", answer="425")]
    draws = [teacher_answers(tasks, 0.6, random.Random(s)) for s in range(400)]
    assert all([t.answer for t in d[1:]] == ["39", "425"] for d in draws)  # no carry / not addition: exact
    carried = [d[0].answer for d in draws]
    assert set(carried) == {"42", "32"}  # right, or the units carry forgotten
    assert 0.5 < carried.count("32") / len(carried) < 0.7  # ~slip
    assert [t.answer for t in teacher_answers(tasks, 0.6, random.Random(7))] == [t.answer for t in draws[7]]
    assert [t.answer for t in teacher_answers(tasks, 1.0, random.Random(0))] == ["32", "39", "425"]
    assert [t.answer for t in teacher_answers(tasks, 0.0, random.Random(0))] == ["42", "39", "425"]
    assert tasks[0].answer == "42"  # the input tasks are not changed


def test_demo_batch_labels_actions_and_their_eos_only(untrained: Path) -> None:
    from flashrl.env import Demo
    from flashrl.models.tiny import demo_batch

    tok = load_tokenizer(untrained)
    demo = Demo(prompt="Guess 0-9:\n", turns=[("5", " higher\n"), ("8", " lower\n"), ("7", "")])
    ids, mask, lab = demo_batch(tok, [demo, Demo(prompt="Guess 0-9:\n", turns=[("3", "")])])
    eos = tok.eos_token_id
    text = "Guess 0-9:\n5" + "\x00" + " higher\n8" + "\x00" + " lower\n7" + "\x00"
    want_ids = [eos if c == "\x00" else tok.encode(c)[0] for c in text]
    assert ids[0].tolist() == want_ids and mask[0].tolist() == [1] * len(want_ids)
    labelled = [i for i, v in enumerate(lab[0].tolist()) if v != -100]
    p = len("Guess 0-9:\n")
    assert labelled == [p, p + 1, p + 10, p + 11, p + 19, p + 20]  # "5" EOS, "8" EOS, "7" EOS
    assert [ids[0, i].item() for i in labelled] == tok.encode("5") + [eos] + tok.encode("8") + [eos] + tok.encode("7") + [eos]
    # the short row is right-padded: no label and no attention past its end
    assert lab[1].tolist()[p:p + 2] == tok.encode("3") + [eos] and set(lab[1].tolist()[p + 2:]) == {-100}
    assert mask[1].sum().item() == p + 2


def test_generate_with_kv_cache_matches_the_prefix_recompute(untrained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past _CACHE_FROM new tokens generate keeps a KV cache; it must decode what the recompute decodes,
    greedy and seeded-sampled, with left-padded prompts of different lengths and rows that stop early."""
    import torch
    from transformers import AutoModelForCausalLM

    import flashrl.models.tiny as tiny

    tok = load_tokenizer(untrained)
    model = AutoModelForCausalLM.from_pretrained(str(untrained), dtype=torch.float32).eval()
    with torch.no_grad():  # sharpen the random init: its near-uniform logits would hide a wrong position or mask
        for p in model.parameters():
            p.mul_(4.0)
    prompts = [tok.encode(p) for p in ("12+3=", "347+85=", "9+9=", "1234567+89=")]
    runs = {}
    for cached in (True, False):
        monkeypatch.setattr(tiny, "_CACHE_FROM", 8 if cached else 10**9)
        greedy = tiny.generate(model, prompts, 40, tok.eos_token_id, tok.pad_token_id)
        sampled = tiny.generate(model, prompts, 40, tok.eos_token_id, tok.pad_token_id, temperature=1.0,
                                generator=torch.Generator().manual_seed(0))
        runs[cached] = (greedy, sampled)
    assert runs[True] == runs[False]
    assert any(len(o) < 40 for o in runs[True][1])  # some sampled row stopped at its EOS: masking exercised


def test_demo_batches_split_wide_batches_into_micro_batches_with_the_same_loss(
        untrained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch wider than _PACK_FROM tokens is trained as length-sorted micro-batches whose weighted losses
    sum to the one batch's loss (and gradient); a narrow batch stays the one batch it always was."""
    import torch
    from transformers import AutoModelForCausalLM

    import flashrl.models.tiny as tiny
    from flashrl.env import Demo
    from flashrl.models.tiny import _PACK_FROM, batch_loss, demo_batch, demo_batches

    monkeypatch.setattr(tiny, "_PACK_TOKENS", 128)
    tok = load_tokenizer(untrained)
    model = AutoModelForCausalLM.from_pretrained(str(untrained), dtype=torch.float32)
    short = [Demo(prompt=f"{i}+{i}=", turns=[(str(2 * i), "")]) for i in range(6)]
    assert isinstance(demo_batches(tok, short), tuple)
    wide = short + [Demo(prompt="1+1=", turns=[("2" * (_PACK_FROM - 2), "")]), Demo(prompt="9=", turns=[("9" * 40, "")])]
    parts = demo_batches(tok, wide)
    assert isinstance(parts, list) and len(parts) > 1
    assert sorted(int(m.sum()) for _, m, _ in parts for m in m) == sorted(int(m.sum()) for m in demo_batch(tok, wide)[1])
    assert all(ids.numel() <= 128 or ids.shape[0] == 1 for ids, _, _ in parts)
    grads = []
    for batch in (demo_batch(tok, wide), parts):
        model.zero_grad(set_to_none=True)
        loss = batch_loss(model, batch)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


class _Scripted:
    """A stand-in causal LM that always answers "5" then EOS, and records every context it is fed."""

    def __init__(self, tok) -> None:
        self.tok, self.seen = tok, []

    def __call__(self, input_ids, attention_mask, position_ids):
        import torch

        rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
        self.seen.append(rows)
        logits = torch.zeros(len(rows), 1, self.tok.vocab_size)
        for i, r in enumerate(rows):
            nxt = self.tok.eos_token_id if r[-1] == self.tok.encode("5")[0] else self.tok.encode("5")[0]
            logits[i, -1, nxt] = 1.0
        return type("Out", (), {"logits": logits})()


def test_play_episodes_lays_out_turns_like_the_rollout(untrained: Path) -> None:
    from envs.guess import GuessParams, GuessSuite
    from flashrl.env import Task
    from flashrl.models.tiny import play_episodes

    tok = load_tokenizer(untrained)
    suite = GuessSuite(GuessParams(max_number=9, max_turns=3), eval_size=1)
    tasks = [Task(id="a", prompt=suite.prompt(), answer="5"), Task(id="b", prompt=suite.prompt(), answer="7")]
    model = _Scripted(tok)
    out = play_episodes(model, tok, suite, tasks, max_new_tokens=3, max_turns=3)
    assert out == [(1.0, True), (0.0, False)]  # found on turn 1; never found in 3 turns
    eos = tok.eos_token_id
    # the last context of episode b: prompt, then per turn "5" EOS + the env's observation
    last = model.seen[-1][-1]
    assert last == tok.encode("Guess 0-9:\n5") + [eos] + tok.encode(" higher\n5") + [eos] + tok.encode(" higher\n5")


def test_demonstrating_env_gets_its_warm_start_and_faults_do_not_change_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from envs.guess import GuessSuite

    monkeypatch.setattr(GuessSuite, "WARM_START", {"max_steps": 3, "batch": 8, "check_every": 3, "probe_size": 8,
                                                   "target_accuracy": 1.0})

    def cfg(params: dict) -> Config:
        return Config(model=ModelConfig(cache_dir=str(tmp_path)), env=EnvConfig(name="guess", params=params, eval_size=8))

    path = ensure_model(cfg({"max_number": 9, "train_size": 50}), SMALL)
    report = json.loads((path / "flashrl_warmstart.json").read_text())
    assert report["steps"] == 3 and report["warm"]["batch"] == 8  # the env's WARM_START, not the defaults
    for key in ("eval_accuracy", "eval_success_sampled"):  # shares of the 8 held-out games
        assert report[key] * 8 == pytest.approx(round(report[key] * 8)), key
    # a found game scores 0.9 ** (turns - 1) with at most 4 turns, a lost one 0
    success, reward = report["eval_success_sampled"], report["eval_reward_sampled"]
    assert 0.9**3 * success - 1e-9 <= reward <= success + 1e-9
    delayed = {"max_number": 9, "train_size": 50, "faults": {"delay": {"kind": "constant", "seconds": 0.5}}}
    assert ensure_model(cfg(delayed), SMALL) == path  # same task, same model: no rebuild for a delay


def test_remote_wrapped_env_warm_starts_on_the_env_it_wraps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from envs import warm_start_overrides
    from envs.guess import GuessSuite

    quick = {"max_steps": 2, "batch": 8, "check_every": 2, "probe_size": 8, "target_accuracy": 1.0}
    monkeypatch.setattr(GuessSuite, "WARM_START", quick)
    inner = {"max_number": 9, "train_size": 50}
    assert warm_start_overrides("remote", {"inner": "guess", "params": inner}) == quick
    assert warm_start_overrides("arithmetic", {}) == {"min_steps": 1500}  # issue 12: no mid-rise stop
    cfg = Config(model=ModelConfig(cache_dir=str(tmp_path)),
                 env=EnvConfig(name="remote", params={"inner": "guess", "params": inner, "workers": 1}, eval_size=8))
    report = json.loads((ensure_model(cfg, SMALL) / "flashrl_warmstart.json").read_text())
    # multi-turn demonstrations of the wrapped game (their report has the sampled success), its overrides
    assert report["steps"] == 2 and "eval_success_sampled" in report


def test_a_build_reports_every_phase_as_plain_lines_without_a_terminal(tmp_path: Path) -> None:
    """`flashrl init-model` piped or in a log: a line as each phase starts and one as it ends (count, the
    last loss / accuracy, seconds), so minutes of warm-start are never silent; the model is the same."""
    import io
    import math
    import re

    from flashrl.models import Progress

    out = io.StringIO()
    progress = Progress("init-model", out, every_s=math.inf)  # no periodic line: the count below is exact
    assert not progress.live  # a StringIO is no terminal
    path = ensure_model(_cfg(tmp_path), SMALL, QUICK, progress=progress)
    lines = out.getvalue().splitlines()
    assert all(line.startswith("init-model: ") for line in lines) and len(lines) == 10
    starts = [line for line in lines if line.endswith(" ...")]
    assert starts == ["init-model: loading the tasks of env arithmetic ...",
                      "init-model: building the untrained model ...",
                      "init-model: loading the model ...",
                      "init-model: warm-start (up to 4 steps) ...",
                      "init-model: held-out accuracy (greedy) (up to 10 problems) ..."]
    done = [line for line in lines if " done in " in line]
    assert re.fullmatch(r"init-model: loading the tasks of env arithmetic: done in \d+\.\d s; 50 tasks, held out 10",
                        done[0])
    assert re.fullmatch(r"init-model: warm-start: done in \d+\.\d s; 4 steps, loss \d+\.\d{3}, "
                        r"probe accuracy \d\.\d{3}", done[3]), done[3]
    report = json.loads((path / "flashrl_warmstart.json").read_text())
    assert done[4].endswith(f"10 problems, accuracy {report['eval_accuracy']:.3f}")
    assert re.fullmatch(r"init-model: loading the model: done in \d+\.\d s; parameters \d+", done[2]), done[2]
    assert ensure_model(_cfg(tmp_path / "quiet"), SMALL, QUICK).name == path.name  # no progress: the same model
    quiet = io.StringIO()
    ensure_model(_cfg(tmp_path), SMALL, QUICK, progress=Progress("init-model", quiet))
    assert quiet.getvalue() == ""  # cached: nothing to report


def test_progress_on_a_terminal_draws_bars_and_says_when_a_phase_failed() -> None:
    import io
    import re

    from flashrl.models import Progress

    out = io.StringIO()
    progress = Progress("init-model", out, live=True)
    with progress.phase("warm-start", total=10) as p:
        for _ in range(4):
            p.advance(1, loss=0.5)
        p.finish()
    text = out.getvalue()
    assert "init-model: warm-start" in text and "4/4" in text and "loss 0.500" in text
    plain = io.StringIO()
    with pytest.raises(RuntimeError), Progress("init-model", plain).phase("warm-start", total=10) as p:
        p.advance(3, loss=1.25)
        raise RuntimeError("out of memory")
    assert plain.getvalue().splitlines()[-1].startswith("init-model: warm-start: failed in ")
    assert plain.getvalue().splitlines()[-1].endswith("; 3 of 10 steps, loss 1.250")
    # `flashrl run`: the lines go to the dashboard's status instead (never a bar over its live view)
    said: list[str] = []
    with Progress("preparing model", io.StringIO(), live=True, say=said.append).phase("warm-start", total=2) as p:
        p.advance(2, loss=0.25)
    assert said[0] == "preparing model: warm-start (up to 2 steps) ..."
    assert re.fullmatch(r"preparing model: warm-start: done in \d+\.\d s; 2 steps, loss 0\.250", said[-1])
    # a long phase without a terminal says where it is every every_s seconds, with the time left
    chatty = io.StringIO()
    with Progress("init-model", chatty, every_s=0.0).phase("warm-start", total=10) as p:
        p.advance(5, loss=0.75)
    assert re.fullmatch(r"init-model: warm-start: 5 of 10 steps, loss 0\.750, about \d+ s left",
                        chatty.getvalue().splitlines()[1])


def test_held_out_episodes_are_played_as_the_rl_eval_plays_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-start report's held-out play of a demonstrating env takes the RL eval's turns and tokens per
    turn (rollout.max_turns, rollout.max_new_tokens), so its numbers are the RL eval's at step 0 (issue 39:
    sized by the teacher's episodes, it played fewer turns than the eval). Sizing by the teacher once also
    drew every sizing demonstration from a fresh random.Random(1) (tool task, seed 1): one turn of 5 tokens
    and a reported held-out success of 0%."""
    from envs.tools import ToolsSuite
    from flashrl.config import RolloutConfig
    from flashrl.models import tiny

    monkeypatch.setattr(ToolsSuite, "WARM_START", {"max_steps": 1, "batch": 4, "check_every": 1, "probe_size": 4,
                                                   "target_accuracy": 1.0})
    calls: list[tuple[int, int, int]] = []

    def fake_play(model, tok, suite, tasks, max_new_tokens, max_turns, temperature=0.0, generator=None):
        calls.append((len(tasks), max_new_tokens, max_turns))
        return [(0.0, False)] * len(tasks)

    monkeypatch.setattr(tiny, "play_episodes", fake_play)
    params = {"train_size": 50, "latency": {"median_s": 0.0, "p99_s": 0.0}}
    cfg = Config(run=RunConfig(seed=1), model=ModelConfig(cache_dir=str(tmp_path)),
                 env=EnvConfig(name="tools", params=params, eval_size=16), rollout=RolloutConfig(max_turns=5, max_new_tokens=17))
    path = ensure_model(cfg, SMALL)
    held_out = [c for c in calls if c[0] == 16]
    assert held_out == [(16, 17, 5), (16, 17, 5)], calls  # greedy, then sampled
    report = json.loads((path / "flashrl_warmstart.json").read_text())
    assert report["eval_turns"] == 5 and report["eval_max_new_tokens"] == 17


def test_a_remote_envs_inner_faults_neither_reach_the_warm_start_nor_change_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[env.params.params.faults] of env.name = "remote" act in the workers at run time; the warm-start plays
    the inner suite in this process, where an injected crash once ended the build (and any rate rebuilt it)."""
    from envs.tools import ToolsSuite

    monkeypatch.setattr(ToolsSuite, "WARM_START", {"max_steps": 1, "batch": 4, "check_every": 1, "probe_size": 4,
                                                   "target_accuracy": 1.0})
    inner = {"train_size": 50, "latency": {"median_s": 0.0, "p99_s": 0.0}}

    def cfg(faults: dict) -> Config:
        params = {"inner": "tools", "workers": 1, "params": inner | ({"faults": faults} if faults else {})}
        return Config(model=ModelConfig(cache_dir=str(tmp_path)), env=EnvConfig(name="remote", params=params, eval_size=8))

    path = ensure_model(cfg({"crash": 1.0}), SMALL)  # every call would crash
    assert ensure_model(cfg({}), SMALL) == path and ensure_model(cfg({"crash": 0.5, "hang": 0.5}), SMALL) == path

"""A Hugging Face chat model end to end: a small Qwen3 (BPE tokenizer, ChatML template) built locally.

Real vLLM engine, real trainer, the real CLI. Checked: a run with chat-template prompts and multi-turn
observation turns trains and syncs; the engines' sampled logprobs equal the trainer's recomputation
(mismatch/kl near 0 every step), and an engine holding other weights shows up as a large mismatch/kl;
the exported final policy, loaded with transformers, decodes greedily exactly as the last engine did.
With the qwen3 template (past <think> reasoning dropped from history): multi-turn rollouts through a
real vLLM engine train exactly the engine's generated ids plus the observation ids, with the engine's
logprobs at the generated positions (recomputed by transformers over the trained sequence), while the
template's re-rendering of the conversations differs (the template-mismatch metric).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from flashrl.config import Config, load, to_toml
from flashrl.metrics import read_jsonl
from flashrl.models.chat_model import build_chat_model
from flashrl.wire.protocol import Generate
from tests.unit.test_chat import Recorder, check_token_exact

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

CONFIG = """
[run]
name = "chat"
output_dir = "{out}"
steps = 3
eval_every = 0
dashboard = "plain"

[model]
path = "{model}"
max_model_len = 256
system_prompt = "Find the hidden number."

[env]
name = "guess"
eval_size = 4
params = {{ max_number = 9, max_turns = 2 }}

[rollout]
group_size = 4
batch_prompts = 2
max_turns = 2
max_new_tokens = 6

[scheduler]
async_ratio = 0

[engine]
count = 1
kv_cache_gib = 0.25

[trainer]
ranks = 1
lr = 1e-3
# mismatch/* over every sampled token: with skip_inert a tied group's samples are not forwarded, so not measured
skip_inert = false

[algorithm]
# random weights earn no reward: the entropy bonus makes every step move the weights (and the sync matter)
entropy_coef = 0.01
"""


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "qwen3")


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


@pytest.mark.timeout(900)
def test_cli_run_with_a_chat_model_trains_syncs_and_exports(tmp_path: Path, chat_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = tmp_path / "chat.toml"
    config.write_text(CONFIG.format(out=tmp_path / "runs", model=chat_dir))
    proc = subprocess.run([sys.executable, "-m", "flashrl.cli", "run", str(config)], cwd=ROOT, capture_output=True,
                          text=True, timeout=800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "chat"
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # async_ratio 0: every token was sampled by the weights its step starts from, and the engine
        # holds exactly the trainer's (synced) weights: engine and trainer logprobs agree
        assert r["mismatch/tokens"] == r["tokens"] > 0
        assert r["mismatch/kl"] < 1e-6, r  # seen: ~4e-13
        assert r["mismatch/max_abs"] < 5e-3, r  # seen: ~3e-6
        assert r["turns/mean"] > 1.0  # multi-turn: observation turns were appended as chat turns
        # ... so the step measured its multi-turn samples against the template's re-rendering (models.md)
        assert r["rollout/template_checked"] >= 1 and 0.0 <= r["rollout/template_mismatch_rate"] <= 1.0, r
    final = run / "final"
    before, after = _weights(chat_dir), _weights(final)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # trained

    exported = tmp_path / "exported"
    res = subprocess.run([sys.executable, "-m", "flashrl.cli", "export", str(run), "--out", str(exported)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert all(torch.equal(model.state_dict()[k], after[k]) for k in after)
    tok = AutoTokenizer.from_pretrained(str(exported))
    assert tok.chat_template and tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)

    # the run's last checkpoint (trainer DCP, step 3) converts to the same weights as final/
    res = subprocess.run([sys.executable, "-m", "flashrl.cli", "export", str(run), "--step", "3", "--out",
                          str(tmp_path / "step3")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "checkpoint step 3" in res.stdout, res.stdout + res.stderr
    step3 = _weights(tmp_path / "step3")
    assert set(step3) == set(after) and all(torch.equal(step3[k], after[k]) for k in after)


@pytest.mark.timeout(900)
def test_engine_matches_trainer_wrong_weights_show_and_export_decodes_like_the_engine(
        tmp_path: Path, chat_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from envs import make_suite
    from flashrl.controller import Controller
    from flashrl.launch import processes
    from flashrl.launch.processes import local_cluster
    from flashrl.models.export import export_run
    from flashrl.models.tokenizer import load_tokenizer

    # The engine starts from other weights (another seed) than the trainer: what a weight that never
    # synced, or synced under a wrong name, looks like to the metric.
    other = build_chat_model(tmp_path / "other", seed=1)
    options = processes.engine_spec

    def options_other(*args, **kwargs):
        return msgspec.structs.replace(options(*args, **kwargs), model=str(other))

    monkeypatch.setattr(processes, "engine_spec", options_other)  # the name the launcher's EnginePool calls
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(CONFIG.format(out=tmp_path / "runs", model=chat_dir))
    cfg = load(cfg_path, ["run.steps=2", "run.dashboard=off", "run.name=wrong"])
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.toml").write_text(to_toml(cfg))
    tok = load_tokenizer(chat_dir, cfg.model.chat_template, cfg.model.system_prompt)
    records: list[dict] = []
    prompts = [tok.encode_prompt(p) for p in ("Guess 0-9:\n", "What is 12 + 7?", "say hi")]
    greedy: list[list[int]] = []

    async def main() -> None:
        async with local_cluster(cfg, chat_dir, cfg.run_dir) as (engines, trainer):
            client = engines[0].client
            suite = make_suite(cfg.env.name, cfg.env.params, cfg.run.seed, cfg.env.eval_size)
            await Controller(cfg, tok, suite, [client], trainer, on_step=lambda r: records.append(r.to_dict())).run()
            # sampled at T = 1 with the model's stop tokens: the engine's logprobs are the trainer's
            for k, p in enumerate(prompts):
                hot = await client.generate(Generate(request_id=f"t{k}", prompt_ids=p, max_tokens=16, temperature=1.0,
                                                     seed=k, stop_token_ids=tok.stop_token_ids))
                assert hot.versions == [2] * len(hot.token_ids)
                assert await trainer.compute_logprobs(p, hot.token_ids) == pytest.approx(hot.logprobs, abs=2e-3)
                g = await client.generate(Generate(request_id=f"g{k}", prompt_ids=p, max_tokens=12, temperature=0.0,
                                                   stop_token_ids=tok.stop_token_ids))
                greedy.append(g.token_ids)
            await trainer.save_model(cfg.run_dir / "final")

    asyncio.run(main())
    steps = [r for r in records if r.get("step", 0) >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    print("mismatch/kl, mismatch/max_abs per step:", [(r["mismatch/kl"], r["mismatch/max_abs"]) for r in steps])
    # step 1 trained on samples of the engine's other weights: far apart; the first sync replaced every
    # weight, so step 2's samples match the trainer again
    assert steps[0]["mismatch/kl"] > 0.1 and steps[0]["mismatch/max_abs"] > 1.0, steps[0]
    assert steps[1]["mismatch/kl"] < 1e-6 and steps[1]["mismatch/max_abs"] < 5e-3, steps[1]

    out, _ = export_run(cfg.run_dir, tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for p, want in zip(prompts, greedy):
        # transformers' greedy search with the exported generation_config (its stop tokens): the same tokens,
        # the same stop
        got = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=12, do_sample=False)
        assert got[0, len(p):].tolist() == want


class _RecordingSuite:
    """The guess suite, each env keeping the (action, observation) of its steps."""

    def __init__(self, suite) -> None:
        self.suite = suite
        self.logs: list[list[tuple[str, str]]] = []

    def __getattr__(self, name: str):
        return getattr(self.suite, name)

    def make_env(self):
        env, log = self.suite.make_env(), []
        self.logs.append(log)
        step = env.step

        async def recorded(action: str):
            res = await step(action)
            log.append((action, res.observation))
            return res

        env.step = recorded
        return env


@pytest.mark.timeout(900)
def test_multiturn_rollouts_on_a_history_rewriting_template_train_the_engines_tokens(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from envs import make_suite
    from flashrl.controller.context import RolloutContext
    from flashrl.controller.group import run_group
    from flashrl.controller.scheduler import Router
    from flashrl.controller.types import Trajectory
    from flashrl.engine.client import spawn_engine
    from flashrl.engine.server import EngineSpec
    from flashrl.env import Task
    from flashrl.models.tokenizer import load_tokenizer
    from flashrl.wire.transport import free_port

    model = build_chat_model(tmp_path / "qwen3-think", template="qwen3")
    tok = load_tokenizer(model, "auto", "Find the hidden number.")
    cfg = msgspec.convert({"rollout": {"max_turns": 3, "max_new_tokens": 8}, "model": {"max_model_len": 256}}, Config)
    spec = EngineSpec(address=f"tcp://127.0.0.1:{free_port()}", model=str(model), name="chat-engine",
                      max_model_len=256, max_num_seqs=16, kv_cache_gib=0.25)
    ep = spawn_engine(spec, tmp_path / "engine.log")
    suite = _RecordingSuite(make_suite("guess", {"max_number": 9, "max_turns": 3}, 0, 4))
    trajs: list[Trajectory] = []

    async def main() -> Recorder:
        await ep.wait_ready(600)
        eng = Recorder(ep.client)
        ctx = RolloutContext(cfg=cfg, tokenizer=tok, suite=suite, engines=[eng], router=Router(1, 16),
                             version=lambda: 0)
        for g in range(2):
            task = Task(id=f"guess-{g}", prompt="Guess 0-9:\n", answer=str(7 + g))
            assert await run_group(ctx, task=task, group=g, need=4, first_index=0, extra=0, temperature=1.0,
                                   on_sample=trajs.append)
        return eng

    try:
        eng = asyncio.run(main())
    finally:
        asyncio.run(ep.terminate(timeout=20))
    assert len(trajs) == 8
    calls = {}
    for req, out in eng.calls:
        calls.setdefault(req.request_id.rsplit(".", 2)[0], []).append((req, out))
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    multi = 0
    for t in trajs:
        mine = sorted(calls[t.sample_id], key=lambda c: int(c[0].request_id.rsplit(".", 1)[1]))
        actions = [tok.decode(list(out.token_ids)) for _, out in mine]
        log = next(lg for lg in suite.logs if [a for a, _ in lg] == actions)
        observations = [o for _, o in log[:-1]]  # the last step ended the episode: nothing appended after it
        check_token_exact(tok, t, mine, observations)
        # the engine's logprobs belong to the trained sequence: transformers over prompt + response, at the
        # generated positions, gives them back (observation positions: mask 0, logprob 0.0)
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(lm(input_ids=ids).logits[0, :-1].float(), -1)
        target = ids[0, 1:]
        got = logp.gather(-1, target[:, None])[:, 0][len(t.prompt_ids) - 1:].tolist()
        gen = [(g, b) for g, b, m in zip(got, t.behav_logp, t.loss_mask) if m]
        assert max(abs(g - b) for g, b in gen) < 2e-3, t.sample_id
        assert all(b == 0.0 for b, m in zip(t.behav_logp, t.loss_mask) if not m)
        if t.turns > 1:
            multi += 1
            assert t.template_mismatch > 0  # past turns lost their "<think>" opening (and any reasoning)
    assert multi >= 4
    print("template_mismatch, retokenize_mismatch per trajectory:",
          [(t.template_mismatch, t.retokenize_mismatch) for t in trajs])

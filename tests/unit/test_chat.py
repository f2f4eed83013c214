"""Chat models: prompts rendered by the model's chat template, observation turns token-exact, stop tokens.

A small Qwen3 chat model is built here (flashrl.models.chat_model: BPE trained on the fly, random
weights, ChatML template); a multi-turn rollout runs through the real rollout coroutine against a
fake engine that answers with that tokenizer's ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from envs import make_suite
from flashrl.config import Config, ConfigError, load
from flashrl.controller.rollout import RolloutContext, RolloutSpec, run_sample
from flashrl.controller.scheduler import Router
from flashrl.env import Task
from flashrl.models.chat import ChatFormat, ChatTemplateError, stop_token_ids
from flashrl.models.chat_model import build_chat_model
from flashrl.models.tokenizer import load_tokenizer
from flashrl.sim.clock import run_virtual
from flashrl.sim.fake import FakeEngine
from flashrl.wire.protocol import Generate

SYSTEM = "You are a careful guesser."

# Qwen3's way: the last assistant turn renders an empty <think> block, earlier ones do not. A template
# whose rendering of a turn depends on what follows it: a plain prefix difference would be wrong.
THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "qwen3", layers=1)


def _render(tok, messages, gen: bool = True) -> list[int]:
    text = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    return tok.hf.encode(text, add_special_tokens=False)


def test_folder_loads_as_a_qwen3_chat_model(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert type(model).__name__ == "Qwen3ForCausalLM" and not model.config.tie_word_embeddings
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    assert hf.chat_template and hf.eos_token == "<|im_end|>" and len(hf) == model.config.vocab_size
    text = "What is 12 + 7? Guess again, higher."
    ids = hf.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) // 2  # BPE merges, not characters
    assert hf.decode(ids) == text
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")]
    assert model(input_ids=torch.tensor([ids])).logits.shape == (1, len(ids), len(hf))
    # seeded: the same folder twice
    from safetensors.torch import load_file

    again = build_chat_model(model_dir.parent / "again", layers=1)
    a, b = load_file(model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (again / "tokenizer.json").read_text() == (model_dir / "tokenizer.json").read_text()


def test_llama_variant_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = build_chat_model(tmp_path / "llama", arch="llama", layers=1)
    assert type(AutoModelForCausalLM.from_pretrained(str(p))).__name__ == "LlamaForCausalLM"
    assert AutoTokenizer.from_pretrained(str(p)).chat_template


def test_prompt_is_the_templates_rendering_with_the_system_prompt(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir, "auto", SYSTEM)
    assert tok.chat is not None
    ids = tok.encode_prompt("Guess 1-9:")
    assert ids == _render(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Guess 1-9:"}])
    assert tok.hf.decode(ids) == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nGuess 1-9:<|im_end|>\n<|im_start|>assistant\n"
    assert load_tokenizer(model_dir).encode_prompt("x") == _render(tok, [{"role": "user", "content": "x"}])
    plain = load_tokenizer(model_dir, "off")
    assert plain.chat is None and plain.encode_prompt("Guess 1-9:") == plain.encode("Guess 1-9:")
    im_end, eot = tok.hf.convert_tokens_to_ids("<|im_end|>"), tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.stop_token_ids == [im_end, eot]  # generation_config.json, in its order


@pytest.mark.parametrize("template", ["chatml", "think"])
def test_observation_turns_keep_the_conversation_token_exact(model_dir: Path, template: str) -> None:
    tok = load_tokenizer(model_dir, "on", SYSTEM)
    if template == "think":
        tok.hf.chat_template = THINK_TEMPLATE
        tok.chat = ChatFormat(tok.hf, SYSTEM, tok.stop_token_ids)
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    head = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Guess 1-9:"}]
    ids = tok.encode_prompt("Guess 1-9:")
    turns = [("5", "higher"), ("7 is my guess", "lower"), ("6", "")]
    msgs = list(head)
    for k, (answer, obs) in enumerate(turns):
        generated = tok.encode(answer) + [im_end]  # the engine stopped on the template's closing token
        ids += generated
        msgs.append({"role": "assistant", "content": answer})
        if obs:
            ids += tok.encode_observation(obs, generated)
            msgs.append({"role": "user", "content": obs})
        if k < len(turns) - 1:
            # prompt + generated + observation ids == the template's tokenization of the whole conversation
            assert ids == _render(tok, msgs)
    # a turn cut off by max_new_tokens (no closing token): the observation closes it first
    cut = tok.encode("12")
    obs = tok.encode_observation("too short", cut)
    assert obs[0] == im_end and tok.hf.decode(obs).startswith("<|im_end|>\n<|im_start|>user\ntoo short<|im_end|>")
    # a turn closed by another stop token (<|endoftext|>) keeps it, and the template's own closing follows
    eot = tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.encode_observation("x", cut + [eot])[0] == im_end


def test_multiturn_rollout_with_a_chat_model_is_token_exact(model_dir: Path) -> None:
    """The real rollout coroutine (guess env, 3 turns) against a fake engine speaking the chat model's ids."""
    tok = load_tokenizer(model_dir, "auto", SYSTEM)
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    guesses = ["4", "6", "7"]

    def script(req: Generate, version: int) -> tuple[list[int], float]:
        turn = int(req.request_id.split(".")[-1])
        return tok.encode(guesses[turn]) + [im_end], 1.0

    cfg = msgspec.convert({"rollout": {"max_turns": 4, "max_new_tokens": 4}, "model": {"max_model_len": 256}}, Config)
    eng = FakeEngine("e0", script)
    ctx = RolloutContext(cfg=cfg, tokenizer=tok, suite=make_suite("guess", {"max_number": 9, "max_turns": 4}, 0, 4),
                         engines=[eng], router=Router(1, cfg.engine.max_num_seqs), version=lambda: 0)
    task = Task(id="guess-x", prompt="Guess 0-9:\n", answer="7")
    spec = RolloutSpec(task=task, group=0, index=0, temperature=1.0, seed_key=(0, 0), sample_id="0-0")
    ctx.router.take(0)
    t = run_virtual(lambda: run_sample(ctx, spec, 0)).result
    assert t.status == "ok" and t.turns == 3 and t.correct
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Guess 0-9:\n"}]
    assert t.prompt_ids == _render(tok, msgs)
    for k, g in enumerate(guesses):
        msgs.append({"role": "assistant", "content": g})
        if k < 2:
            msgs.append({"role": "user", "content": " higher\n"})
    whole = _render(tok, msgs, gen=False)  # ends "...7<|im_end|>\n": the trajectory ends at <|im_end|>
    assert t.prompt_ids + t.response_ids == whole[:-1] and tok.hf.decode(whole[-1:]) == "\n"
    gen = [tok.encode(g) + [im_end] for g in guesses]
    assert [i for i, m in zip(t.response_ids, t.loss_mask) if m] == gen[0] + gen[1] + gen[2]
    # every request carried the model's stop tokens; each turn's prompt is the previous ids, never re-tokenized
    assert all(r.stop_token_ids == tok.stop_token_ids for r in eng.requests)
    assert eng.requests[2].prompt_ids == (t.prompt_ids + t.response_ids)[: len(eng.requests[2].prompt_ids)]


def test_stop_tokens_and_template_errors(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_token_ids(tmp_path, 3) == [7, 3]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ChatTemplateError, match="eos_token_id must be an int or a list of ints"):
        stop_token_ids(tmp_path)
    assert stop_token_ids(tmp_path / "none", 2) == [2]
    with pytest.raises(ChatTemplateError, match="system prompt needs a chat template"):
        load_tokenizer(model_dir, "off", SYSTEM)
    from flashrl.models.tiny import TinySpec, build_untrained

    tiny = build_untrained(tmp_path / "tiny", spec=TinySpec(layers=1, hidden=32, heads=1, kv_heads=1, intermediate=64))
    assert load_tokenizer(tiny).chat is None  # auto: no template, raw text
    with pytest.raises(ChatTemplateError, match='has no chat template; set model.chat_template = "off"'):
        load_tokenizer(tiny, "on")


def test_chat_config_keys_are_checked() -> None:
    assert load(None, ["model.path=/some/folder", "model.system_prompt=Be brief."]).model.system_prompt == "Be brief."
    with pytest.raises(ConfigError, match="model.system_prompt: the built-in model has no chat template"):
        load(None, ["model.system_prompt=hi"])
    with pytest.raises(ConfigError, match="model.chat_template: the built-in model has no chat template"):
        load(None, ["model.chat_template=on"])
    with pytest.raises(ConfigError, match='model.system_prompt: a system prompt needs the chat template, but model.chat_template = "off"'):
        load(None, ["model.path=/m", "model.chat_template=off", "model.system_prompt=hi"])
    with pytest.raises(ConfigError, match="model.chat_template: invalid value 'yes'"):
        load(None, ["model.chat_template=yes"])

"""A small real-architecture chat model, built offline: what a user's Hugging Face folder looks like.

``build_chat_model(path)`` writes a folder that transformers and vLLM load like any downloaded chat
model, with nothing downloaded::

    config.json + model.safetensors   Qwen3ForCausalLM (or LlamaForCausalLM), random weights (seeded)
    tokenizer.json                    byte-level BPE trained here with `tokenizers` on a generated corpus
    tokenizer_config.json             special tokens <|endoftext|> <|im_start|> <|im_end|>, a ChatML
    (+ chat_template.jinja)           chat template (system / user / assistant turns)
    generation_config.json            eos_token_id = [<|im_end|>, <|endoftext|>]: the stop tokens

``template="qwen3"`` (``--template qwen3``) gives it a reasoning template in Qwen3's manner instead
(``QWEN3_TEMPLATE``): ``<think>`` / ``</think>`` are added tokens, the generation prompt opens a
``<think>`` block, and earlier assistant turns are rendered without their reasoning. A template
that rewrites history: re-rendering a finished multi-turn conversation does not give back the
tokens the model saw while generating it (flashrl/models/chat.py, ``ChatFormat.template_mismatch``).

It exists to exercise the paths a real chat model takes (chat template, multi-token stop list,
BPE merges across words, Qwen3's q/k norms, untied embeddings) on the CPU, in tests and examples.
``init_std`` is larger than a trained model's so that greedy decoding has clear winners (random
weights at the usual 0.02 give near-uniform logits, where float rounding picks the argmax).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

__all__ = ["CHATML_TEMPLATE", "QWEN3_TEMPLATE", "SIZES", "SPECIAL_TOKENS", "TEMPLATES", "THINK_TOKENS",
           "build_chat_model", "corpus"]

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
THINK_TOKENS = ("<think>", "</think>")  # added (not special) tokens of the qwen3 template: decoded text keeps them

# ChatML, as Qwen and many others ship it (without Qwen3's <think> handling). A missing system
# message is simply absent: the configured system prompt (model.system_prompt) adds one.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Reasoning in Qwen3's manner (written here; what matters is that it drops past reasoning as Qwen3's does):
#  - the generation prompt opens the reasoning block: "<|im_start|>assistant\n<think>\n"; the model writes
#    its reasoning, "</think>", then its answer;
#  - an assistant turn before the last user turn (history) keeps only its answer: the text after its last
#    "</think>", leading newlines dropped; reasoning and the "<think>" the generation prompt opened are gone;
#  - an assistant turn after the last user turn (the one being answered) is rendered as it was generated:
#    the "<think>\n" opening, then its content verbatim.
# So the tokens a multi-turn trajectory was generated from are not what the template renders for the
# finished conversation: the template rewrites history, as Qwen3's does.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}"
    "{%- if loop.index0 < ns.last_user %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n<think>\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)

TEMPLATES = {"chatml": CHATML_TEMPLATE, "qwen3": QWEN3_TEMPLATE}

_WORDS = (
    "the a an of to and in is it you that he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part guess answer question solve what is plus minus times equals correct "
    "wrong higher lower try again think step because therefore sum total result"
).split()


# Named shapes for ``build_chat_model(size=...)`` / ``--size``: "tiny" is the test model; "0.25b" is a
# real-size Qwen3 (0.27B parameters, untied: 16 layers x 12.6M + 2 x 33.6M of 32k-token embeddings),
# Qwen3-0.6B's width and head layout at 16 of its 28 layers and a 32k BPE vocabulary.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128, vocab_size=512, max_position=512,
                 init_std=0.2),
    "0.25b": dict(layers=16, hidden=1024, heads=16, kv_heads=8, intermediate=3072, vocab_size=32768,
                  max_position=4096, init_std=0.05),
}

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]


def _lexicon(n_words: int, rng: random.Random) -> list[str]:
    """``n_words`` distinct made-up words of 1-4 syllables (the long tail a real vocabulary learns)."""
    words: set[str] = set()
    while len(words) < n_words:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
    return sorted(words)


def corpus(n_lines: int = 4000, seed: int = 0, lexicon: int = 0) -> list[str]:
    """Deterministic training text for the BPE: word salad, arithmetic, and chat-shaped lines.

    ``lexicon`` > 0 adds ``n_lines`` more lines of made-up words (that many distinct ones, Zipf-like
    frequencies): enough distinct text for a BPE of tens of thousands of tokens; 0 keeps the small
    corpus (and so the tiny tokenizer) exactly as it was."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.4:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))).capitalize() + ".")
        elif kind < 0.8:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            val = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"What is {a} {op} {b}? {a}{op}{b}={val}")
        elif kind < 0.9:
            lines.append(f"<|im_start|>{rng.choice(['system', 'user', 'assistant'])}\n"
                         f"{' '.join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))}<|im_end|>\n")
        else:
            lines.append(f"Guess a number between 1 and {rng.randint(10, 100)}: {rng.randint(1, 100)} is too "
                         f"{rng.choice(['high', 'low'])}.")
    if lexicon > 0:
        lex = _lexicon(lexicon, rng)
        weights = [1.0 / (k + 1) for k in range(len(lex))]
        for _ in range(n_lines):
            lines.append(" ".join(rng.choices(lex, weights, k=rng.randint(4, 16))).capitalize() + ".")
    return lines


def _train_tokenizer(vocab_size: int, seed: int, template: str = "chatml"):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        show_progress=False,
    )
    # a real-size vocabulary needs more distinct text than the small corpus has merges for
    big = vocab_size > 4096
    text = corpus(n_lines=200_000, seed=seed, lexicon=vocab_size) if big else corpus(seed=seed)
    tok.train_from_iterator(text, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,  # a chat model's turn ends with <|im_end|>
        pad_token=ENDOFTEXT,
        unk_token=None,
        chat_template=TEMPLATES[template],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    if template == "qwen3":
        hf.add_tokens(list(THINK_TOKENS))  # one token each, as in Qwen3; not special, so decoding keeps them
    return hf


def build_chat_model(
    path: str | Path,
    *,
    arch: Literal["qwen3", "llama"] = "qwen3",
    size: str = "tiny",
    seed: int = 0,
    template: Literal["chatml", "qwen3"] = "chatml",
    **shape: Any,
) -> Path:
    """Write the chat model folder (module docstring) to ``path``; return it. Same ``seed``, same folder.

    ``template``: "chatml" (plain turns) or "qwen3" (reasoning blocks, dropped from earlier turns:
    ``QWEN3_TEMPLATE``); the qwen3 one adds the two ``THINK_TOKENS`` to the vocabulary.

    ``size`` names a shape of ``SIZES``; keyword ``shape`` entries (layers, hidden, heads, kv_heads,
    intermediate, vocab_size, max_position, init_std) override single fields of it.
    head size = hidden / heads must be one vLLM's CPU attention supports (32, 64, ...).
    """
    if template not in TEMPLATES:
        raise ValueError(f"build_chat_model: unknown template {template!r}; use one of {sorted(TEMPLATES)}")
    if size not in SIZES:
        raise ValueError(f"build_chat_model: unknown size {size!r}; use one of {sorted(SIZES)}")
    unknown = set(shape) - set(SIZES[size])
    if unknown:
        raise TypeError(f"build_chat_model: unknown shape fields {sorted(unknown)}; use {sorted(SIZES[size])}")
    g = {**SIZES[size], **shape}
    layers, hidden, heads, kv_heads = g["layers"], g["hidden"], g["heads"], g["kv_heads"]
    intermediate, vocab_size, max_position, init_std = g["intermediate"], g["vocab_size"], g["max_position"], g["init_std"]
    import torch
    from transformers import GenerationConfig

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(vocab_size, seed, template)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_position,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        initializer_range=init_std,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        torch_dtype="float32",
    )
    config: Any
    cls: Any
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config, cls = Qwen3Config(**common), Qwen3ForCausalLM
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config, cls = LlamaConfig(**common), LlamaForCausalLM
    torch.manual_seed(seed)
    model: Any = cls(config)
    model = model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT], eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT]
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m flashrl.models.chat_model OUT [--arch llama] [--template qwen3] [--seed N]``: write the folder to OUT."""
    import argparse

    ap = argparse.ArgumentParser(description="write a small random-weight chat model folder (Qwen3 or Llama)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="a named shape (SIZES)")
    ap.add_argument("--layers", type=int, default=None, help="override the size's number of layers")
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="chatml",
                    help="chatml: plain turns; qwen3: <think> reasoning, dropped from earlier assistant turns")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    extra = {"layers": a.layers} if a.layers else {}
    print(build_chat_model(a.out, arch=a.arch, size=a.size, seed=a.seed, template=a.template, **extra))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

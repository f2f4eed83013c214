"""The chat-model builder's named sizes (flashrl/models/chat_model.py: SIZES): the real-size shape is a
Qwen3 of >= 0.25B parameters (counted on the meta device, nothing built), and bad names are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashrl.models.chat_model import SIZES, build_chat_model, corpus


def test_real_size_shape_is_a_quarter_billion_parameter_qwen3() -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    g = SIZES["0.25b"]
    cfg = Qwen3Config(vocab_size=g["vocab_size"], hidden_size=g["hidden"], intermediate_size=g["intermediate"],
                      num_hidden_layers=g["layers"], num_attention_heads=g["heads"],
                      num_key_value_heads=g["kv_heads"], head_dim=g["hidden"] // g["heads"], tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == 268_471_296  # bench/results/realsize: the model the real-size run trained
    assert g["hidden"] // g["heads"] in (64, 128)  # a head size vLLM's CPU attention supports


def test_bad_size_or_field_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        build_chat_model(tmp_path / "x", size="huge")
    with pytest.raises(TypeError, match="unknown shape fields"):
        build_chat_model(tmp_path / "x", widht=3)


def test_lexicon_corpus_keeps_the_small_corpus_and_adds_distinct_words() -> None:
    small = corpus(n_lines=200)
    big = corpus(n_lines=200, lexicon=1000)
    assert big[:200] == small  # the tiny tokenizer's corpus is unchanged
    words = {w.strip(".").lower() for line in big[200:] for w in line.split()}
    assert len(big) == 400 and len(words) > 300

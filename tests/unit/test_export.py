"""Export: the policy as a Hugging Face folder, from a state dict (the run's final) or a DCP checkpoint.

The end-to-end check (a real run, exported, greedy outputs equal to the last engine's) is in
tests/integration/test_chat_run.py; here the folder format, atomicity, checkpoint reading and errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashrl.models.chat_model import build_chat_model
from flashrl.models.export import ExportError, save_hf_folder
from flashrl.models.tiny import TinySpec, build_untrained

SMALL = TinySpec(layers=1, hidden=32, heads=1, kv_heads=1, intermediate=64, max_position=64)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "m", layers=1)


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)


def _changed(path: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """The model of ``path`` with every weight moved (as training would)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in _load(path).state_dict().items()}


@pytest.mark.parametrize("which", ["chat", "tiny"])
def test_save_hf_folder_loads_in_transformers_with_the_new_weights(tmp_path: Path, chat_dir: Path, which: str) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    base = chat_dir if which == "chat" else build_untrained(tmp_path / "tiny", spec=SMALL)
    sd = _changed(base)
    if which == "tiny":  # tied embeddings: the state dict holds both names of one tensor
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    out = save_hf_folder(sd, base, tmp_path / "out")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    got = _load(out).state_dict()
    assert set(got) == set(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert AutoTokenizer.from_pretrained(str(out)).encode("12+3=") == AutoTokenizer.from_pretrained(str(base)).encode("12+3=")
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == GenerationConfig.from_pretrained(str(base)).eos_token_id
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left

    with pytest.raises(ExportError, match="already exists; choose another --out"):
        save_hf_folder(sd, base, out)
    save_hf_folder(_changed(base, seed=2), base, out, replace=True)
    assert not torch.equal(_load(out).state_dict()["model.norm.weight"], got["model.norm.weight"])
    half = save_hf_folder(sd, base, tmp_path / "half", dtype="bfloat16")
    assert _load(half).state_dict()["model.norm.weight"].dtype == torch.float32  # loaded as asked, stored bf16
    assert "bfloat16" in (half / "config.json").read_text()


def test_bad_weights_are_refused_and_leave_nothing(tmp_path: Path, chat_dir: Path) -> None:
    sd = _changed(chat_dir)
    del sd["model.norm.weight"]
    with pytest.raises(ExportError, match="missing"):
        save_hf_folder(sd, chat_dir, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []

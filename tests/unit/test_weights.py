"""Weight-sync wire format (flashrl/wire/weights.py) and transport, without vLLM: manifest, checksums, gloo broadcast."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from flashrl.engine.weights import DropMessages, WeightReceiver, quiet_sync_chatter
from flashrl.trainer.weights import WeightSender
from flashrl.wire import weights as tw
from flashrl.wire.protocol import ENGINE_REQUESTS, UpdateWeights, encode
from flashrl.wire.weights import bucket_checksum, build_manifest, unpack_bucket, verify_checksum


def _state_dict(tied: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 32, generator=g)
    sd = {
        "model.embed_tokens.weight": emb,
        "model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 64, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
    }
    sd["lm_head.weight"] = emb if tied else emb.clone()
    return sd


def test_manifest_round_trip_respects_bucket_size_and_dtype() -> None:
    sd = _state_dict()
    # 10 KiB buckets: up_proj and down_proj (8 KiB each) cannot share one, embed (6.25 KiB) gets its own.
    manifest, flats = build_manifest(sd, version=7, bucket_mb=10 / 1024)
    assert manifest.version == 7
    layout = [(b.dtype, [s.name for s in b.tensors]) for b in manifest.buckets]
    assert layout == [
        ("float32", ["model.embed_tokens.weight"]),
        ("float32", ["model.layers.0.mlp.up_proj.weight"]),
        ("float32", ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]),
        ("bfloat16", ["model.layers.0.input_layernorm.weight"]),
    ]
    seen = {}
    for bucket, flat in zip(manifest.buckets, flats):
        assert flat.numel() == bucket.numel and str(flat.dtype) == f"torch.{bucket.dtype}"
        assert verify_checksum(flat, bucket.checksum) == bucket.checksum
        seen.update(dict(unpack_bucket(bucket, flat)))
    assert set(seen) == set(sd) - {"lm_head.weight"}
    for name, t in seen.items():
        assert torch.equal(t, sd[name]), name
    # The manifest survives the wire (UpdateWeights is what the engine decodes).
    decoded = ENGINE_REQUESTS.decode(encode(UpdateWeights(manifest=manifest)))
    assert decoded.manifest == manifest


def test_one_big_bucket_holds_everything_in_order() -> None:
    sd = _state_dict()
    manifest, _ = build_manifest(sd, version=1, bucket_mb=64)
    assert [len(b.tensors) for b in manifest.buckets] == [4, 1]  # float32 bucket, bfloat16 bucket
    assert manifest.buckets[0].numel == 50 * 32 + 64 * 32 + 32 * 64 + 32


def test_tied_embeddings_are_sent_once() -> None:
    tied, _ = build_manifest(_state_dict(tied=True), 1, 64)
    names = [s.name for b in tied.buckets for s in b.tensors]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    # A copied state dict lost the sharing: detection keeps both, the explicit flag drops lm_head.
    untied_sd = _state_dict(tied=False)
    kept, _ = build_manifest(untied_sd, 1, 64)
    assert "lm_head.weight" in [s.name for b in kept.buckets for s in b.tensors]
    forced, _ = build_manifest(untied_sd, 1, 64, tie_word_embeddings=True)
    assert "lm_head.weight" not in [s.name for b in forced.buckets for s in b.tensors]


@pytest.mark.parametrize("algo", ["xxh3", "sha256", "sum16"])
def test_corruption_changes_the_checksum(algo: str) -> None:
    flat = torch.randn(10_000)
    good = bucket_checksum(flat, algo)
    assert good.startswith(algo + ":")
    one = flat.clone()
    one[1234] = torch.nextafter(one[1234], torch.tensor(float("inf")))  # one ulp
    swapped = flat.clone()
    swapped[:100], swapped[100:200] = flat[100:200].clone(), flat[:100].clone()
    zeros = torch.zeros_like(flat)
    for bad in (one, swapped, zeros, flat[:-1].contiguous()):
        assert verify_checksum(bad, good) != good
    assert verify_checksum(flat.clone(), good) == good


def test_sum16_matches_a_reference_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    flat = torch.randn(5000)
    w = flat.numpy().view(np.int16).astype(object)  # exact Python ints
    s1 = sum(w) % (1 << 64)
    s2 = sum((i + 1) * x for i, x in enumerate(w)) % (1 << 64)
    expected = f"sum16:{flat.numel() * 4}:{s1}:{s2}"
    assert bucket_checksum(flat, "sum16") == expected
    monkeypatch.setattr(tw, "_WORDS_PER_CHUNK", 777)  # many chunks, a ragged last one
    monkeypatch.setattr(tw, "_positions", {})
    assert bucket_checksum(flat, "sum16") == expected


class _Layer(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.quant_method = object()  # what marks a vLLM layer


def _model(tied: bool) -> torch.nn.Module:
    emb = torch.nn.Parameter(torch.randn(4, 2))
    return torch.nn.ModuleList([_Layer(emb), _Layer(emb if tied else torch.nn.Parameter(torch.randn(4, 2)))])


@pytest.mark.parametrize("tied", [True, False])
def test_vllms_per_sync_chatter_is_filtered_and_nothing_else(tied: bool) -> None:
    """vLLM logs 4 expected lines per weight sync; they leave the engine's log. A layer that really failed to
    load still shows, and so does the LM head's warning when the embeddings are not tied (a missed weight)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    names = ["vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace",
             "vllm.v1.core.block_pool"]
    loggers = [logging.getLogger(n) for n in names]
    handler = Keep()
    for lg in loggers:
        lg.addHandler(handler)
    try:
        quiet_sync_chatter(_model(tied))
        quiet_sync_chatter(_model(tied))  # a second call replaces the filters, not adds to them
        layerwise, inplace, block_pool = loggers
        assert all(sum(isinstance(f, DropMessages) for f in lg.filters) == 1 for lg in loggers)
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "ParallelLMHead")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")
        inplace.info("Reloading and processing weights took %.2f seconds", 0.01)
        block_pool.info("Successfully reset prefix cache")
        block_pool.warning("Failed to reset prefix cache because some blocks (3) are not freed yet")
        expected = ["QKVParallelLinear: Failed to load weights",
                    "Failed to reset prefix cache because some blocks (3) are not freed yet"]
        if not tied:
            expected.insert(0, "ParallelLMHead: Failed to load weights")
        assert seen == expected
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
            for f in [f for f in lg.filters if isinstance(f, DropMessages)]:
                lg.removeFilter(f)


def test_receive_before_init_says_what_to_do() -> None:
    manifest, _ = build_manifest(_state_dict(), 1, 64)
    with pytest.raises(RuntimeError, match="before InitWeightSync"):
        WeightReceiver().receive(manifest)
    with pytest.raises(RuntimeError, match="send InitWeightSync to the trainer first"):
        WeightSender().send([])


def test_refresh_tied_layers_reprocesses_only_layers_sharing_a_weight() -> None:
    from flashrl.engine.weights import refresh_tied_layers

    calls: list[str] = []

    class Method:  # stands in for vLLM's quant_method (CPU: re-packs the GEMM weight)
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            calls.append(layer.tag)

    def layer(tag: str, weight: torch.nn.Parameter) -> torch.nn.Module:
        m = torch.nn.Module()
        m.weight, m.quant_method, m.tag = weight, Method(), tag
        return m

    shared = torch.nn.Parameter(torch.randn(4, 4))
    model = torch.nn.ModuleList([layer("embed", shared), layer("mlp", torch.nn.Parameter(torch.randn(4, 4))),
                                 layer("lm_head", shared)])
    assert refresh_tied_layers(model) == 2
    assert calls == ["embed", "lm_head"]

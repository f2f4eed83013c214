"""Weight-sync wire format (flashrl/wire/weights.py) and transport, without vLLM: manifest, checksums, gloo broadcast."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from flashrl.engine.weights import DropMessages, WeightReceiver, WeightSyncExtension, quiet_sync_chatter
from flashrl.trainer.weights import WeightSender
from flashrl.wire import weights as tw
from flashrl.wire.protocol import ENGINE_REQUESTS, UpdateWeights, encode
from flashrl.wire.transport import free_port
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


@pytest.mark.parametrize("algo", ["sha256", "sum16"])
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


def test_unknown_dtype_and_algorithm_are_named() -> None:
    with pytest.raises(ValueError, match="torch.int64 is not supported"):
        build_manifest({"x": torch.zeros(3, dtype=torch.int64)}, 1, 1)
    with pytest.raises(ValueError, match="unknown algorithm 'md5'"):
        bucket_checksum(torch.zeros(3), "md5")
    assert verify_checksum(torch.zeros(3), "md5:abc") != "md5:abc"
    with pytest.raises(ValueError, match="backend 'mpi' is not supported"):
        tw.join_group("127.0.0.1", free_port(), 0, 1, "mpi", 5)


def _run_receiver(port: int, manifests: list, out: list) -> threading.Thread:
    def body() -> None:
        recv = WeightReceiver()
        recv.init("127.0.0.1", port, 1, 2, "gloo", 30)
        for m in manifests:
            out.append(recv.receive(m))

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th


def test_gloo_broadcast_delivers_and_verifies_and_stays_aligned_after_a_bad_bucket() -> None:
    sd = _state_dict()
    good, flats = build_manifest(sd, 1, bucket_mb=10 / 1024)
    bad = msgspec_copy(good)
    bad.buckets[1].checksum = "sha256:" + "0" * 64
    port = free_port()
    out: list = []
    # The receiver gets the bad manifest first, then the good one: the group must stay aligned.
    th = _run_receiver(port, [bad, good], out)
    sender = WeightSender()
    sender.join("e0", "127.0.0.1", port, "gloo", 30)
    assert sender.send(flats)[1] == {}
    assert sender.send(flats, ["e0"])[1] == {}
    th.join(30)
    assert not th.is_alive()
    (named_bad, errors_bad), (named_good, errors_good) = out
    assert len(errors_bad) == 1 and errors_bad[0].startswith("bucket 1 (model.layers.0.mlp.up_proj.weight")
    assert "up_proj" not in " ".join(n for n, _ in named_bad)
    assert errors_good == []
    assert {n for n, _ in named_good} == set(sd) - {"lm_head.weight"}
    for name, t in named_good:
        assert torch.equal(t, sd[name])


class _Worker(WeightSyncExtension):
    """vLLM's worker as the extension sees it: reload_weights and a model to look at (no tied layers)."""

    def __init__(self) -> None:
        self.loaded: list[list[str]] = []
        self.model_runner = SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2))

    def reload_weights(self, weights_iterator) -> None:
        self.loaded.append([name for name, _ in weights_iterator])


def test_only_what_the_last_receive_verified_is_loaded_and_only_once() -> None:
    """The receive (beside generation) and the load (between two engine steps) are two calls: the load
    takes what the last receive verified, for its version, once; a rejected receive leaves nothing to load."""
    sd = _state_dict()
    good, flats = build_manifest(sd, 1, bucket_mb=10 / 1024)
    bad = msgspec_copy(good)
    bad.version = 2
    bad.buckets[0].checksum = "sha256:" + "0" * 64
    port = free_port()
    worker = _Worker()
    replies: list = []

    def engine() -> None:
        worker.flashrl_init_weight_sync("127.0.0.1", port, 1, 2, "gloo", 30)
        replies.append(worker.flashrl_load_weights(1))  # nothing received yet
        replies.append(worker.flashrl_receive_weights(msgspec.json.encode(good).decode()))
        replies.append(worker.flashrl_load_weights(2))  # not the version received: refused, and what came is dropped
        replies.append(worker.flashrl_receive_weights(msgspec.json.encode(good).decode()))
        replies.append(worker.flashrl_load_weights(1))
        replies.append(worker.flashrl_load_weights(1))  # loaded already
        replies.append(worker.flashrl_receive_weights(msgspec.json.encode(bad).decode()))
        replies.append(worker.flashrl_load_weights(2))

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    sender = WeightSender()
    sender.join("e0", "127.0.0.1", port, "gloo", 30)
    for _ in range(3):
        assert sender.send(flats)[1] == {}
    th.join(30)
    assert not th.is_alive()
    empty, got1, wrong, got2, load1, again, got_bad, load_bad = replies
    assert not empty["ok"] and not empty["touched"] and "nothing" in empty["error"]
    assert got1["ok"] and got1["receive_s"] >= got1["verify_s"] > 0
    assert not wrong["ok"] and not wrong["touched"] and "holds v1" in wrong["error"]
    assert got2["ok"] and load1["ok"] and load1["touched"]
    assert not again["ok"] and not again["touched"] and "nothing" in again["error"]
    assert not got_bad["ok"] and "checksum" in got_bad["error"]
    assert not load_bad["ok"] and not load_bad["touched"]
    assert len(worker.loaded) == 1 and set(worker.loaded[0]) == set(sd) - {"lm_head.weight"}  # once, every tensor


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


# An engine that joins its group, then dies (os._exit) before the broadcast: a separate process, so its
# sockets really close as a SIGKILLed engine's do.
_DYING_RECEIVER = """
import os, sys
from flashrl.engine.weights import DropMessages, WeightReceiver, WeightSyncExtension, quiet_sync_chatter
WeightReceiver().init("127.0.0.1", int(sys.argv[1]), 1, 2, "gloo", 30)
print("joined", flush=True)
os._exit(9)
"""


def test_one_group_per_engine_a_dead_engine_fails_alone_and_fast() -> None:
    """Two engines, each in its own group; one dies before the sync. The live one gets every bucket
    (verified), the dead one is reported and forgotten, well before the group timeout."""
    sd = _state_dict()
    manifest, flats = build_manifest(sd, 1, bucket_mb=10 / 1024)
    sender = WeightSender()
    live_port, dead_port = free_port(), free_port()
    out: list = []
    th = _run_receiver(live_port, [manifest, manifest], out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    dying = subprocess.Popen([sys.executable, "-c", _DYING_RECEIVER, str(dead_port)], env=env, stdout=subprocess.PIPE)
    joins = [threading.Thread(target=sender.join, args=(p, "127.0.0.1", port, "gloo", 30))
             for p, port in (("live", live_port), ("dead", dead_port))]
    for t in joins:
        t.start()
    for t in joins:
        t.join(60)
    assert sorted(sender.peers) == ["dead", "live"]
    assert dying.wait(timeout=60) == 9
    t0 = time.monotonic()
    _, failed = sender.send(flats)
    took = time.monotonic() - t0
    assert list(failed) == ["dead"] and took < 10  # the group timeout is 30 s: nobody waited for it
    assert sender.peers == ["live"]  # the dead engine must join again (a restart: a new group)
    _, again = sender.send(flats, ["live", "dead"])  # a later sync: the live one again, the dead one named
    assert list(again) == ["dead"] and "not in the weight sync" in again["dead"]
    th.join(30)
    assert not th.is_alive()
    for named, errors in out:
        assert errors == [] and {n for n, _ in named} == set(sd) - {"lm_head.weight"}


def test_receive_before_init_says_what_to_do() -> None:
    manifest, _ = build_manifest(_state_dict(), 1, 64)
    with pytest.raises(RuntimeError, match="before InitWeightSync"):
        WeightReceiver().receive(manifest)
    with pytest.raises(RuntimeError, match="send InitWeightSync to the trainer first"):
        WeightSender().send([])


def msgspec_copy(m):  # a deep copy through the wire format
    return ENGINE_REQUESTS.decode(encode(UpdateWeights(manifest=m))).manifest


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

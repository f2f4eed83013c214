"""weight_sync.load = "bucket" (flashrl/engine/weights.py: BucketStream, flashrl_open_stream / flashrl_load_stream;
flashrl/wire/weights.py: check_manifest), without sockets: the broadcast is a fake group that copies the trainer's
buckets when a receive is waited on, and the loader mimics vLLM's layer-wise reload, which keeps a layer's tensors
until the layer's last one arrives (possibly in a later bucket). The real engine's bucket mode is
tests/integration/test_bucket_load_process.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from flashrl.config import Config
from flashrl.engine.weights import WeightSyncExtension
from flashrl.launch.processes import engine_spec
from flashrl.wire.protocol import WeightManifest
from flashrl.wire.weights import build_manifest, check_manifest, manifest_nbytes

LAYERS = 8


def _sd(seed: int) -> dict[str, torch.Tensor]:
    """Layers of three tensors (like vLLM's fused qkv), 10 KiB each: with 16 KiB buckets most layers span two."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(LAYERS):
        for part in ("q", "k", "v"):
            sd[f"layers.{i}.{part}"] = torch.randn(80, 32, generator=g)
    sd["norm"] = torch.randn(4096, generator=g).to(torch.bfloat16)
    return sd


class _Work:
    def __init__(self, dst: torch.Tensor, src: torch.Tensor, fails: bool = False) -> None:
        self.dst, self.src, self.fails = dst, src, fails

    def wait(self) -> None:  # the bytes land when the receive is waited on, as a real transfer's do
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        self.dst.copy_(self.src.view(self.dst.dtype).reshape(self.dst.shape))


class _Group:
    """The engine's end of a weight-sync group, fed from the trainer's buckets; ``corrupt``: bucket indexes whose
    bytes arrive changed."""

    def __init__(self, flats: list[torch.Tensor], corrupt: tuple[int, ...] = (), fail_from: int | None = None) -> None:
        self.flats = flats
        self.corrupt = corrupt
        self.fail_from = fail_from  # from this bucket on, every receive fails (the trainer died)
        self.posted = 0

    def broadcast(self, t: torch.Tensor, root: int) -> _Work:
        src = self.flats[self.posted]
        if self.posted in self.corrupt:
            src = src.clone()
            src[len(src) // 2] += 1
        self.posted += 1
        assert t.numel() == src.numel() and t.dtype == src.dtype, "the receive must match the bucket"
        return _Work(t, src, self.fail_from is not None and self.posted > self.fail_from)


class _Worker(WeightSyncExtension):
    """vLLM's worker as the extension sees it. ``reload_weights`` keeps each layer's tensors (views of the receive
    buffers) until its last one arrived, then copies them, as vLLM 0.32's layer-wise reload does; a receive buffer
    reused too early would show as a wrong value here."""

    def __init__(self) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)
        self.model = torch.nn.Linear(4, 4)
        self.loaded: dict[str, torch.Tensor] = {}
        self.seen: list[str] = []
        self.max_held = 0

    def reload_weights(self, weights_iterator: Any) -> None:
        held: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, t in weights_iterator:
            self.seen.append(name)
            layer = name.rsplit(".", 1)[0] if name.startswith("layers.") else name
            held.setdefault(layer, []).append((name, t))
            self.max_held = max(self.max_held, sum(len(v) for v in held.values()))
            if len(held[layer]) == (3 if name.startswith("layers.") else 1):
                for n, v in held.pop(layer):
                    self.loaded[n] = v.clone()
        for items in held.values():  # what never completed: processed at the end, as vLLM's finalize does
            for n, v in items:
                self.loaded[n] = v.clone()


def _sync(worker: _Worker, manifest: WeightManifest, flats: list[torch.Tensor], corrupt: tuple[int, ...] = ()
          ) -> tuple[_Group, dict[str, Any], dict[str, Any] | None]:
    group = _Group(flats, corrupt)
    worker._flashrl_receiver()._group = group  # type: ignore[assignment]  # the fake stands in for gloo's
    opened = worker.flashrl_open_stream(msgspec.json.encode(manifest).decode())
    loaded = worker.flashrl_load_stream(manifest.version) if opened["ok"] else None
    return group, opened, loaded


def test_check_manifest_names_what_would_break_a_load_before_a_byte_arrives() -> None:
    manifest, _ = build_manifest(_sd(0), 1, bucket_mb=16 / 1024)
    assert check_manifest(manifest) == []
    assert manifest_nbytes(manifest) == LAYERS * 3 * 80 * 32 * 4 + 4096 * 2
    bad = msgspec.json.decode(msgspec.json.encode(manifest), type=WeightManifest)
    bad.buckets[1].numel += 1
    bad.buckets[2].dtype = "int4"
    bad.buckets[3].checksum = "md5:00"
    bad.buckets[4].tensors[0].dtype = "bfloat16"
    bad.buckets[5].tensors.append(bad.buckets[0].tensors[0])
    bad.buckets[5].numel += 80 * 32
    errors = check_manifest(bad)
    assert any(e.startswith("bucket 1: holds") for e in errors)
    assert any("bucket 2: unsupported dtype 'int4'" in e for e in errors)
    assert any("bucket 3: unknown checksum algorithm 'md5'" in e for e in errors)
    assert any(e.startswith("bucket 4: layers.") and "is bfloat16 in a float32 bucket" in e for e in errors)
    assert any(e == "bucket 5: layers.0.q is sent twice" for e in errors), errors
    assert check_manifest(WeightManifest(version=1)) == ["the manifest lists no bucket"]


def test_bucket_by_bucket_loads_exactly_and_holds_a_few_buckets_not_the_model() -> None:
    worker = _Worker()
    ptrs: list[set[int]] = []
    for version in (1, 2, 3):
        sd = _sd(version)
        manifest, flats = build_manifest(sd, version, bucket_mb=16 / 1024)
        assert len(manifest.buckets) >= 8
        group, opened, loaded = _sync(worker, manifest, flats)
        assert opened["ok"] and loaded is not None and loaded["ok"], (opened, loaded)
        assert loaded["touched"] and loaded["error"] == "" and group.posted == len(flats)
        assert set(worker.loaded) == set(sd) and all(torch.equal(worker.loaded[n], sd[n]) for n in sd)
        biggest = max(f.numel() * f.element_size() for f in flats)
        # the bound: the bucket loading, the one posted next, and those a partly-loaded layer still holds (here
        # a layer's three tensors are in three buckets: 5 of 25 buckets)
        assert 0 < loaded["extra_bytes"] <= 5 * biggest <= manifest_nbytes(manifest) / 4, loaded["extra_bytes"]
        ptrs.append({s.buf.data_ptr() for s in worker._flashrl_receiver()._slots})
        worker.loaded.clear()
    assert worker.max_held >= 2  # layers did span buckets: the reuse had to wait for them
    assert ptrs[1] == ptrs[2]  # a later sync allocates nothing: the slots are reused (no fresh-page faults)


def test_a_corrupt_bucket_mid_sync_stops_the_load_names_the_bucket_and_takes_the_whole_broadcast() -> None:
    sd = _sd(1)
    manifest, flats = build_manifest(sd, 4, bucket_mb=16 / 1024)
    worker = _Worker()
    group, opened, loaded = _sync(worker, manifest, flats, corrupt=(3,))
    assert opened["ok"] and loaded is not None
    assert not loaded["ok"] and loaded["touched"]  # the model is partly written: the server must never serve it
    assert loaded["error"].startswith(f"bucket 3 of {len(flats)} (") and "checksum" in loaded["error"]
    assert f"3 of {len(flats)} buckets were loaded" in loaded["error"] and "must not serve" in loaded["error"]
    assert group.posted == len(flats)  # every bucket still received: the trainer's broadcast ends cleanly
    bad_names = {s.name for b in manifest.buckets[3:] for s in b.tensors}
    assert not bad_names & set(worker.seen)  # nothing of the bad bucket, nor after it, reached the loader
    assert worker.seen == [s.name for b in manifest.buckets[:3] for s in b.tensors]
    # the next sync is clean: the receiver holds no stream, and a good sync loads
    manifest2, flats2 = build_manifest(_sd(2), 5, bucket_mb=16 / 1024)
    _, opened2, loaded2 = _sync(worker, manifest2, flats2)
    assert opened2["ok"] and loaded2 is not None and loaded2["ok"]


def test_a_transfer_failing_mid_sync_is_an_answer_touched_never_an_escape() -> None:
    """The trainer dies at bucket 4: the load answers (it does not raise out of the worker), touched, naming the
    failure, and the partly-loaded model is the server's to refuse (it halts and exits on touched)."""
    manifest, flats = build_manifest(_sd(1), 3, bucket_mb=16 / 1024)
    worker = _Worker()
    worker._flashrl_receiver()._group = _Group(flats, fail_from=4)  # type: ignore[assignment]
    assert worker.flashrl_open_stream(msgspec.json.encode(manifest).decode())["ok"]
    res = worker.flashrl_load_stream(3)
    assert not res["ok"] and res["touched"] and "Connection closed by peer" in res["error"], res
    assert "must not serve" in res["error"] and worker._flashrl_receiver().stream is None


def test_a_corrupt_first_bucket_or_a_bad_manifest_is_refused_before_anything_loads() -> None:
    sd = _sd(1)
    manifest, flats = build_manifest(sd, 2, bucket_mb=16 / 1024)
    worker = _Worker()
    group, opened, loaded = _sync(worker, manifest, flats, corrupt=(0,))
    assert not opened["ok"] and loaded is None and opened["error"].startswith("bucket 0 of")
    assert group.posted == len(flats) and worker.seen == []  # all received, none loaded
    assert worker.flashrl_load_stream(2)["touched"] is False  # nothing opened to load
    bad = msgspec.json.decode(msgspec.json.encode(manifest), type=WeightManifest)
    bad.buckets[-1].numel -= 1
    flats_bad = [*flats[:-1], flats[-1][:-1]]
    group, opened, loaded = _sync(worker, bad, flats_bad)
    assert not opened["ok"] and opened["error"].startswith("manifest refused before loading: bucket")
    assert group.posted == len(flats) and worker.seen == []


def test_a_load_for_another_version_is_refused_untouched() -> None:
    manifest, flats = build_manifest(_sd(1), 7, bucket_mb=16 / 1024)
    worker = _Worker()
    worker._flashrl_receiver()._group = _Group(flats)  # type: ignore[assignment]
    assert worker.flashrl_open_stream(msgspec.json.encode(manifest).decode())["ok"]
    res = worker.flashrl_load_stream(8)
    assert not res["ok"] and not res["touched"] and "holds v7" in res["error"] and worker.seen == []


@pytest.mark.parametrize("mode", ["whole", "bucket"])
def test_extra_bytes_whole_mode_is_the_model_bucket_mode_a_few_buckets(mode: str) -> None:
    sd = _sd(3)
    manifest, flats = build_manifest(sd, 1, bucket_mb=16 / 1024)
    worker = _Worker()
    worker._flashrl_receiver()._group = _Group(flats)  # type: ignore[assignment]
    text = msgspec.json.encode(manifest).decode()
    if mode == "whole":
        got = worker.flashrl_receive_weights(text)
        assert got["ok"] and got["extra_bytes"] == manifest_nbytes(manifest)
    else:
        assert worker.flashrl_open_stream(text)["ok"]
        got = worker.flashrl_load_stream(1)
        assert got["ok"] and got["extra_bytes"] < manifest_nbytes(manifest) / 2


@pytest.mark.parametrize("mode", ["whole", "bucket"])
def test_weight_sync_load_reaches_every_engine_spec(mode: str) -> None:
    cfg = msgspec.convert({"weight_sync": {"load": mode}}, Config)
    assert engine_spec(cfg, Path("/m"), 1, "cpu", "ipc://x").sync_load == mode
    assert msgspec.convert({}, Config).weight_sync.load == "whole"  # the default, measured: see docs/design.md

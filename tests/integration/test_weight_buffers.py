"""The engine's host receive buffers (flashrl/engine/weights.py: WeightReceiver.release): a receive after a
release reuses the last receive's buffers (no page faults on fresh memory) and still delivers exactly what
was sent; a buffer that shares memory with a live parameter, or one never released, is never reused."""

from __future__ import annotations

import threading

import torch

from flashrl.engine.weights import WeightReceiver
from flashrl.trainer.weights import WeightSender
from flashrl.wire.transport import free_port
from flashrl.wire.weights import build_manifest


def _sd(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300, 40, generator=g), "b": torch.randn(5000, generator=g).to(torch.bfloat16),
            "c": torch.randn(64, 64, generator=g)}


def _ptrs(named: list[tuple[str, torch.Tensor]]) -> set[int]:
    return {t.untyped_storage().data_ptr() for _, t in named}


def _exact(named: list[tuple[str, torch.Tensor]], sd: dict[str, torch.Tensor]) -> bool:
    """Checked right after the receive: a reused buffer's earlier contents are overwritten by design."""
    return {n for n, _ in named} == set(sd) and all(torch.equal(t, sd[n]) for n, t in named)


def test_released_buffers_are_reused_and_the_data_is_still_exact() -> None:
    versions = [_sd(s) for s in range(5)]
    packed = [build_manifest(sd, v, bucket_mb=0.05) for v, sd in enumerate(versions)]
    port = free_port()
    seen: list = []

    def engine() -> None:
        recv = WeightReceiver()
        recv.init("127.0.0.1", port, 1, 2, "gloo", 30)
        named, errors = recv.receive(packed[0][0])
        seen.append((named, errors, _ptrs(named), _exact(named, versions[0])))
        kept = recv.release()  # loaded (copied into the model): reusable
        named, errors = recv.receive(packed[1][0])
        seen.append((named, errors, _ptrs(named), _exact(named, versions[1]), kept))
        recv.release([named[0][1]])  # a "parameter" still views the first bucket: that one is not reused
        named, errors = recv.receive(packed[2][0])
        seen.append((named, errors, _ptrs(named), _exact(named, versions[2])))
        named, errors = recv.receive(packed[3][0])  # nothing released: every buffer is new
        seen.append((named, errors, _ptrs(named), _exact(named, versions[3])))

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    sender = WeightSender()
    sender.join("e0", "127.0.0.1", port, "gloo", 30)
    for _, flats in packed[:4]:
        assert sender.send(flats)[1] == {}
    th.join(30)
    assert not th.is_alive()
    (n0, e0, p0, x0), (n1, e1, p1, x1, kept), (n2, e2, p2, x2), (n3, e3, p3, x3) = seen
    assert e0 == e1 == e2 == e3 == []
    assert x0 and x1 and x2 and x3  # every receive delivered exactly what was sent, into reused buffers or not
    assert kept == sum(f.numel() * f.element_size() for f in packed[0][1])
    assert p1 == p0  # every buffer reused
    first = n1[0][1].untyped_storage().data_ptr()
    assert first not in p2 and len(p2 & p1) == len(p1) - 1  # all but the aliased one
    assert not p3 & p2  # nothing released: nothing reused

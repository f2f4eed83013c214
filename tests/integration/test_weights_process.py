"""Weight-sync wire format (flashrl/wire/weights.py) and transport, without vLLM: manifest, checksums, gloo broadcast.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_weights.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from flashrl.engine.weights import WeightReceiver, WeightSyncExtension
from flashrl.trainer.weights import WeightSender
from flashrl.wire import weights as tw
from flashrl.wire.protocol import ENGINE_REQUESTS, UpdateWeights, encode
from flashrl.wire.transport import free_port
from flashrl.wire.weights import bucket_checksum, build_manifest, verify_checksum
from tests.unit.test_weights import _state_dict


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


# An engine that joins its group, then dies (os._exit) before the broadcast: a separate process, so its
# sockets really close as a SIGKILLed engine's do.
_DYING_RECEIVER = """
import os, sys
from flashrl.engine.weights import DropMessages, WeightReceiver, WeightSyncExtension, quiet_sync_chatter
WeightReceiver().init("127.0.0.1", int(sys.argv[1]), 1, 2, "gloo", 30)
print("joined", flush=True)
os._exit(9)
"""


def _with_a_peer_process(manifests: list, script: str, name: str, timeout_s: float
                         ) -> tuple[WeightSender, threading.Thread, list, subprocess.Popen[bytes]]:
    """A sender joined by two engines: "live" (a receiver thread here, taking ``manifests``) and ``name`` (the
    receiver ``script`` in a process of its own, so that its sockets close or hang as a real engine's do)."""
    sender = WeightSender()
    live_port, port = free_port(), free_port()
    out: list = []
    th = _run_receiver(live_port, manifests, out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", script, str(port)], env=env, stdout=subprocess.PIPE)
    joins = [threading.Thread(target=sender.join, args=(p, "127.0.0.1", at, "gloo", timeout_s))
             for p, at in (("live", live_port), (name, port))]
    for t in joins:
        t.start()
    for t in joins:
        t.join(60)
    if sorted(sender.peers) != sorted(["live", name]):
        proc.kill()
        raise AssertionError(f"not every engine joined: {sender.peers}")
    return sender, th, out, proc


def test_one_group_per_engine_a_dead_engine_fails_alone_and_fast() -> None:
    """Two engines, each in its own group; one dies before the sync. The live one gets every bucket
    (verified), the dead one is reported and forgotten, well before the group timeout."""
    sd = _state_dict()
    manifest, flats = build_manifest(sd, 1, bucket_mb=10 / 1024)
    sender, th, out, dying = _with_a_peer_process([manifest, manifest], _DYING_RECEIVER, "dead", 30)
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


def msgspec_copy(m):  # a deep copy through the wire format
    return ENGINE_REQUESTS.decode(encode(UpdateWeights(manifest=m))).manifest


# An engine that joins its group, then hangs (never receives): its sockets stay open, so gloo's send to it
# waits the group's whole timeout unless the sender is told the engine is dead.
_HUNG_RECEIVER = """
import sys, time
from flashrl.engine.weights import WeightReceiver
receiver = WeightReceiver()  # kept: its group's sockets stay open
receiver.init("127.0.0.1", int(sys.argv[1]), 1, 2, "gloo", 60)
print("joined", flush=True)
time.sleep(600)
"""


def test_a_dropped_peer_ends_the_send_at_once_and_the_others_get_every_bucket() -> None:
    """Two engines; one hangs after joining (a send to it would wait the 60 s group timeout, and the live
    engine's later buckets with it: each bucket goes to every peer before the next). While the send waits,
    ``drop`` (the controller's DropWeightPeer when it finds the engine dead) ends that wait at once: the
    live engine gets every bucket, verified; the hung one is reported dropped; its unfinished broadcast
    is counted ``stuck`` until the process is gone."""
    sd = _state_dict()
    manifest, flats = build_manifest(sd, 1, bucket_mb=10 / 1024)
    assert len(flats) > 1
    sender, th, out, hung = _with_a_peer_process([manifest], _HUNG_RECEIVER, "hung", 60)
    try:
        result: list = []
        send = threading.Thread(target=lambda: result.append(sender.send(flats)))
        send.start()
        send.join(3)
        assert send.is_alive() and th.is_alive(), "the send (and the live engine) should wait on the hung engine"
        t0 = time.monotonic()
        assert sender.drop("hung") and not sender.drop("hung")
        send.join(10)
        assert not send.is_alive() and time.monotonic() - t0 < 5  # not the 60 s group timeout
        _, failed = result[0]
        assert list(failed) == ["hung"] and "dropped" in failed["hung"]
        assert sender.peers == ["live"] and sender.stuck == 1
        th.join(30)
        assert not th.is_alive()
    finally:
        hung.kill()
        hung.wait(30)
    deadline = time.monotonic() + 30
    while sender.stuck and time.monotonic() < deadline:  # the process is gone: gloo ends the broadcast
        time.sleep(0.1)
    assert sender.stuck == 0
    assert len(out) == 1
    for named, errors in out:
        assert errors == [] and {n for n, _ in named} == set(sd) - {"lm_head.weight"}

"""Wire messages: every message round-trips; malformed frames are rejected with a clear error."""

from __future__ import annotations

import msgspec
import pytest

from flashrl.wire import protocol as P


def _engine_requests() -> list[P.Msg]:
    manifest = P.WeightManifest(
        version=3,
        buckets=[P.Bucket(tensors=[P.TensorSpec("w", [2, 3], "float32")], numel=6, dtype="float32", checksum="abc")],
    )
    return [
        P.Generate(rid=1, request_id="p1-s0", prompt_ids=[1, 2, 3], max_tokens=5, temperature=0.7, seed=11, stop_token_ids=[0]),
        P.Abort(rid=2, request_ids=["a", "b"]),
        P.Pause(rid=3, mode="abort"),
        P.Resume(rid=4),
        P.InitWeightSync(rid=5, master_port=1234, rank=2, world_size=3),
        P.UpdateWeights(rid=6, manifest=manifest),
        P.GetLoad(rid=7),
        P.Ping(rid=8),
        P.Shutdown(rid=9),
    ]


@pytest.mark.parametrize("msg", _engine_requests(), ids=lambda m: type(m).__name__)
def test_engine_requests_round_trip(msg: P.Msg) -> None:
    back = P.ENGINE_REQUESTS.decode(P.encode(msg))
    assert type(back) is type(msg)
    assert back == msg


def test_engine_replies_round_trip() -> None:
    msgs = [
        P.Generated(rid=1, request_id="x", token_ids=[4, 5], logprobs=[-0.5, -1.25], versions=[0, 1], finish_reason="length"),
        P.WeightsUpdated(rid=2, version=4, ok=False, error="checksum mismatch in bucket 0"),
        P.LoadReport(rid=3, engine="e0", running=3, busy_fraction=0.5),
        P.Ok(rid=4),
        P.Pong(rid=5, version=2),
        P.Error(rid=6, message="boom"),
    ]
    for m in msgs:
        assert P.ENGINE_REPLIES.decode(P.encode(m)) == m


def test_trainer_messages_round_trip() -> None:
    sample = P.Trajectory(
        prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 0, 1], behav_logp=[-0.1, 0.0, -0.2],
        versions=[0, -1, 1], reward=1.0, group=7, sample_id="g7-s0",
    )
    step = P.TrainStep(rid=1, batch=P.TrainBatch(step=2, samples=[sample]))
    back = P.TRAINER_REQUESTS.decode(P.encode(step))
    assert back == step
    assert back.batch.samples[0].versions == [0, -1, 1]
    assert P.TRAINER_REPLIES.decode(P.encode(P.TrainResult(rid=2, step=2, metrics={"loss": 0.5}))).metrics == {"loss": 0.5}


def test_garbage_frame_rejected() -> None:
    with pytest.raises(P.ProtocolError, match="malformed engine request"):
        P.ENGINE_REQUESTS.decode(b"\xff\x00garbage")


def test_unknown_message_type_rejected() -> None:
    frame = msgspec.msgpack.encode({"type": "FormatDisk", "rid": 1})
    with pytest.raises(P.ProtocolError, match="Invalid value 'FormatDisk'"):
        P.ENGINE_REQUESTS.decode(frame)


def test_reply_type_not_accepted_as_request() -> None:
    # an engine must not accept a reply-shaped frame as a request
    with pytest.raises(P.ProtocolError):
        P.ENGINE_REQUESTS.decode(P.encode(P.Generated(request_id="x")))


def test_wrong_field_type_rejected() -> None:
    frame = msgspec.msgpack.encode({"type": "Generate", "rid": 1, "prompt_ids": ["a"]})
    with pytest.raises(P.ProtocolError, match=r"Expected `int`, got `str` - at `\$.prompt_ids\[0\]`"):
        P.ENGINE_REQUESTS.decode(frame)


def test_unknown_field_rejected() -> None:
    frame = msgspec.msgpack.encode({"type": "Ping", "rid": 1, "evil": True})
    with pytest.raises(P.ProtocolError, match="unknown field `evil`"):
        P.ENGINE_REQUESTS.decode(frame)

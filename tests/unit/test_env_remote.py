"""envs/remote.py, the parts that need no worker process: its messages cross the wire intact, without pickle.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_env_remote_process.py."""

from __future__ import annotations

import pytest

from envs import make_suite
from envs.remote import WORKER_REPLIES, WORKER_REQUESTS, EnvReset, EnvStepped
from flashrl.env import StepResult, Task
from flashrl.wire.protocol import ProtocolError, encode

TASK = Task(id="g", prompt="Guess 0-9:\n", answer="6")


def test_messages_round_trip_without_pickle() -> None:
    msg = EnvReset(session=3, task=TASK)
    assert WORKER_REQUESTS.decode(encode(msg)) == msg
    with pytest.raises(ProtocolError):
        WORKER_REPLIES.decode(encode(msg))  # a request is not a valid reply
    with pytest.raises(ValueError, match=r"^env\.params: Object missing required field `inner` \(env 'remote'\)"):
        make_suite("remote", {"workers": 2}, 0, 4)
    with pytest.raises(ValueError, match=r"^env\.params\.params\.max_numbr: unknown key for env 'guess'; did you mean `max_number`\? \[env\.params\.params\] accepts: max_number, "):
        make_suite("remote", {"inner": "guess", "params": {"max_numbr": 3}}, 0, 4)


def test_stepped_reply_crosses_the_wire_intact() -> None:
    """A worker's step result reaches the suite as it left: the reply type and every field of the result."""
    sent = EnvStepped(result=StepResult(observation=" obs ", reward=0.5, done=False, info={"correct": True, "n": 2}))
    assert WORKER_REPLIES.decode(encode(sent)) == sent
    assert WORKER_REPLIES.decode(encode(EnvStepped())) == EnvStepped()  # the defaults (omitted on the wire) too

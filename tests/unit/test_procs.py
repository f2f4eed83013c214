"""procs.py, the parts that need no child process: the paused-gc helper.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_procs_process.py."""

from __future__ import annotations

import gc


def test_paused_gc_pauses_collection_then_freezes_what_was_made() -> None:
    from flashrl.procs import paused_gc

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with paused_gc():
            assert not gc.isenabled()
            kept = [[i] for i in range(1000)]  # made while paused: moved into the permanent generation
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(kept)
        gc.disable()  # a caller that had paused the collector itself keeps it paused
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()

"""The unit suite's rule: no test here starts a process or opens a socket (tests/isolation.py says how).

The guard is module-scoped and autouse, so it is in place before any other fixture of a unit module
(module-scoped ones included: a fixture that builds a torch.distributed group is caught too) and is
lifted when the module ends, so tests/integration, collected in the same session, is untouched.
A test that catches the refusal is still failed: every refusal is recorded and checked after the test.
"""

from __future__ import annotations

from collections.abc import Iterator

import matplotlib.font_manager  # noqa: F401  (see below)
import pytest

from tests.isolation import MESSAGE, forbid

# matplotlib builds its per-user font cache on first import by running `fc-list`, a process the guard below
# refuses. On a machine where the cache exists (the one that built the project) nothing runs; on a new one
# (an empty HOME, as in CI) the first unit test that plots would fail. Build it here, before any guard.

_refused: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _no_processes_no_sockets() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        forbid(mp, _refused.append)
        yield


@pytest.fixture(autouse=True)
def _no_swallowed_refusal(_no_processes_no_sockets: None) -> Iterator[None]:
    _refused.clear()
    yield
    if _refused:
        calls = ", ".join(sorted(set(_refused)))
        _refused.clear()
        pytest.fail(f"{MESSAGE} (it called {calls})", pytrace=False)

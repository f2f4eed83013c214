"""The built-in model: char tokenizer, untrained build (transformers loads it), ensure_model cache.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_models.py."""

from __future__ import annotations

from pathlib import Path

from tests.unit import test_models

untrained = test_models.untrained  # the unit module's fixture, shared


def test_builtin_tokenizer_loads_without_transformers(untrained: Path) -> None:
    """The controller loads it while the engines and trainer import: transformers would be ~5 s of CPU."""
    import subprocess
    import sys

    code = ("import sys; from flashrl.models.tokenizer import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
            "print(type(t.hf).__name__, t.encode('1+2='), sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(untrained)], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    assert out[0] == "TokenizerFile" and out[-1] == "[]", out

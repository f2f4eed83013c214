"""envs/code.py, the parts that run no sandbox: extracting and grading an answer's code.

The unit tests (no process, no socket); those that start real processes or open sockets are tests/integration/test_env_code_process.py."""

from __future__ import annotations

from envs.code import extract_code, grade


def test_extract_and_grade() -> None:
    assert extract_code("text\n```python\nA\n```\nmore") == "A\n"
    assert extract_code("def f(x): return 1<eos>") == "def f(x): return 1"
    assert grade('N [["ok", 1], ["raised", "E"], ["ok", true]]\n', "N ", [1, 2, 1]) == 1
    assert grade('N [["ok", 1]]\n', "N ", [1, 2]) == 0  # wrong length
    assert grade("nothing\n", "N ", [1]) == 0

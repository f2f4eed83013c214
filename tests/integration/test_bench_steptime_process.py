"""`flashrl bench steptime`: phase statistics, start-up from the run's logs, the comparison table.

The tests here start real processes or open sockets; the unit tests (none of either) are tests/unit/test_bench_steptime.py."""

from __future__ import annotations

import json
from pathlib import Path

from flashrl.bench.steptime import CpuSampler


def test_cpu_sampler_counts_a_busy_child_between_two_step_counts(tmp_path: Path) -> None:
    """A real process tree: the child burns CPU while 'steps' are appended; its CPU per step is counted."""
    import subprocess
    import sys
    import time

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 2.5: pass\n"
    child = subprocess.Popen([sys.executable, "-c", burn])
    sampler = CpuSampler(child.pid, metrics, skip=1, every=0.1)
    try:
        for step in range(1, 9):
            with metrics.open("a") as f:
                f.write(json.dumps({"step": step, "time/step_s": 0.25}) + "\n")
            time.sleep(0.25)
    finally:
        child.wait(timeout=30)
    cpu = sampler.close()
    assert cpu["steps"] >= 4
    role = cpu["roles"]["other"]  # the busy child: not a flashrl process
    # a busy process uses most of a core: ~250 ms of CPU per 250 ms step (loaded machines give less)
    assert 60 < role["ms_per_step"] < 400
    assert 0 < role["share_of_cores"] <= 1.0

"""`flashrl run` with cluster.interface = this machine's non-loopback address: every engine and trainer
socket on TCP with this run's CURVE keys, torch.distributed and the weight-sync stores on that address,
an unauthenticated peer refused by a real engine; trains to the end and leaves nothing behind.

Real processes (about a minute on 2 cores): slow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq

from flashrl.launch.base import LaunchError, primary_address
from flashrl.metrics import read_jsonl
from flashrl.wire import protocol as P

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _wait_for(what: str, check, proc: subprocess.Popen, timeout: float):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"flashrl run exited ({proc.returncode}) before {what}"
        got = check()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout:.0f} s")


@pytest.mark.timeout(600)
def test_run_over_tcp_with_curve_on_a_non_loopback_address(tmp_path: Path) -> None:
    try:
        ip = primary_address()
    except LaunchError as e:
        pytest.skip(f"this machine has no non-loopback address: {e}")
    run_dir = tmp_path / "net"
    cmd = [
        sys.executable, "-m", "flashrl.cli", "run", str(ROOT / "configs" / "tiny.toml"),
        "--set", f"run.output_dir={tmp_path}", "--set", "run.name=net", "--set", "run.steps=4",
        "--set", "run.eval_every=0", "--set", "run.dashboard=plain",
        "--set", "run.max_time_s=0", "--set", f"cluster.interface={ip}",
        "--set", "engine.count=2",  # each engine's socket and weight-sync group on that address
    ]
    env = dict(os.environ, FLASHRL_PARENT_PID=str(os.getpid()))  # dies with this test
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    keys_file = run_dir / "secrets" / "curve-keys.json"
    logs = run_dir / "logs"
    ctx = zmq.Context()
    try:
        keys = _wait_for("key file", lambda: keys_file.exists() and keys_file.stat().st_size and keys_file, proc, 120)
        assert oct(keys.stat().st_mode & 0o777) == "0o600"
        secrets = [v for k, v in json.loads(keys.read_text()).items() if k.endswith("secret")]
        pattern = re.compile(rf"serving \S+ on (tcp://{re.escape(ip)}:\d+)")

        def engine_address() -> str | None:
            m = pattern.search((logs / "engine0.log").read_text()) if (logs / "engine0.log").exists() else None
            return m.group(1) if m else None

        addr = _wait_for("engine0 serving", engine_address, proc, 300)
        # a peer without the run's keys: no reply, refused by the engine (and logged there)
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.connect(addr)
        intruder.send(P.encode(P.Ping(rid=1)))
        replies = intruder.poll(2000)
        intruder.close(linger=0)
        out, _ = proc.communicate(timeout=420)
        assert replies == 0, "an unauthenticated peer got a reply from a CURVE engine"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # The intruder's context, closed with a deadline: once a full suite hung here for good in libzmq's
        # zmq_ctx_term (the intruder closed, its reconnects to the engine, gone by then, still being torn
        # down), where pytest-timeout's signal cannot interrupt it. destroy closes any socket still open.
        closer = threading.Thread(target=ctx.destroy, kwargs={"linger": 0}, daemon=True)
        closer.start()
        closer.join(10)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # every step's weights went out over the network, except a version an eval held back and the next one
    # replaced (time/sync/skipped, controller/publisher.py): it is never sent; the last step's always is
    steps = [r for r in rows if r["step"] >= 1]
    assert max(r["step"] for r in rows) == 4 and all(r["time/weight_sync_s"] > 0 or r.get("time/sync/skipped")
                                                     for r in steps)
    assert steps[-1]["time/weight_sync_s"] > 0

    controller = (logs / "controller.log").read_text()
    for i in range(2):  # the weight-sync rendezvous: chosen by the launcher on the trainer's address, reported
        assert re.search(rf"weight sync group engine{i}: master {re.escape(ip)}:\d+", controller), controller[-2000:]
        assert re.search(rf"engine engine{i} on tcp://{re.escape(ip)}:\d+", controller)
    assert re.search(rf"trainer group: 1 rank\(s\), rank 0 at tcp://{re.escape(ip)}:\d+, torch.distributed master "
                     rf"{re.escape(ip)}:\d+", controller)
    assert f"rank 0 serving tcp://{ip}:" in (logs / "trainer0.log").read_text()
    engine0 = (logs / "engine0.log").read_text()
    assert "refused 1 unauthenticated connection attempt(s)" in engine0 and "transport/refused = 1" in engine0
    # the keys never reached a log or the output, and are gone with the run
    everything = text + "".join(p.read_text(errors="replace") for p in logs.iterdir())
    for s in secrets:
        assert s not in everything
    assert not keys_file.exists()
    left = [p for p in psutil.process_iter(["cmdline", "environ"]) if p.pid != os.getpid() and str(tmp_path) in
            " ".join(p.info["cmdline"] or []) + " ".join((p.info["environ"] or {}).values())]  # run folder, key file
    assert [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []

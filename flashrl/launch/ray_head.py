"""A private local Ray instance (``cluster.ray.address = ""``) as a supervised child of the driver.

    driver (flashrl run)                         python -m flashrl.launch.ray_head   (Child.spawn: session leader)
      Child.spawn(...)                             procs.child_init(whole_session=True)
      waits for "Ray runtime started" (deadline)     `ray start --head --block --port=P ...` (same session;
      ray.init(address=<TEMP>/ray_current_cluster)                  it setpgid()s itself, Ray's daemons follow it)
      close(): stop() = SIGTERM -> this module      gcs_server, raylet, dashboard agent, workers ...
        -> SIGTERM `ray start` (Ray's own orderly stop of this instance only), then SIGKILL the session

Why a session and not the process group: `ray start --block` moves itself (and so every daemon it starts)
into a process group of its own, so the parent's usual "kill my group" misses them; nobody in Ray calls
setsid, so everything of the instance stays in this child's session. The driver SIGKILLed: the parent-death
signal / watchdog of procs.child_init SIGKILL the whole session. Never a global `ray stop` (other Ray
clusters on the machine are not ours).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from flashrl import procs

READY = "Ray runtime started"  # what `ray start` prints once the head answers
STOP_S = 10.0  # how long `ray start` gets to stop its daemons on SIGTERM before the session is SIGKILLed
MIN_RAY = (2, 52)  # RAY_AUTH_MODE=token (the head's token of its own, below) came with Ray 2.52


def check_version(version: str) -> str | None:
    """Why Ray ``version`` cannot run a private head (its token authentication is missing), else None."""
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) >= MIN_RAY:
        return None
    want = ".".join(map(str, MIN_RAY))
    return (f"cluster.ray.address = \"\" starts a private Ray instance with token authentication, which needs "
            f"Ray >= {want}; this Python has Ray {version}: pip install 'ray[default]>={want}' (or set "
            "cluster.ray.address to a running Ray cluster)")


def ray_cli() -> str:
    """The `ray` script beside this Python (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name("ray")
    return str(here) if here.exists() else "ray"


def command(port: int, num_cpus: int, ports: list[int], temp_dir: str) -> list[str]:
    """`ray start` for a private head; every fixed default port (client server 10001, dashboard 8265, agent
    52365) replaced by a free one, so that it does not collide with another Ray instance on the machine; its
    own temp dir, so that the machine's /tmp/ray/ray_current_cluster (what address = "auto" finds) stays."""
    client, dashboard, agent = ports
    return [ray_cli(), "start", "--head", "--block", f"--port={port}", f"--temp-dir={temp_dir}",
            f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats",
            f"--ray-client-server-port={client}", f"--dashboard-port={dashboard}",
            f"--dashboard-agent-listen-port={agent}"]


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashrl.launch.ray_head")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--num-cpus", type=int, required=True)
    ap.add_argument("--temp-dir", required=True)
    ap.add_argument("--ports", type=int, nargs=3, required=True, metavar=("CLIENT", "DASHBOARD", "AGENT"))
    args = ap.parse_args(argv)
    procs.child_init("ray-head", whole_session=True)
    # `ray start` dies with this process even when it is SIGKILLed (its group then goes with Ray's own reaper)
    ray = subprocess.Popen(command(args.port, args.num_cpus, args.ports, args.temp_dir),
                           stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)  # noqa: PLW1509 - prctl only
    stopping = threading.Event()

    def stop(signum: int, frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while ray.poll() is None and not stopping.is_set():
        stopping.wait(0.2)
    if ray.poll() is None:  # asked to stop: Ray's orderly stop of this instance, bounded
        ray.send_signal(signal.SIGTERM)
        try:
            ray.wait(STOP_S)
        except subprocess.TimeoutExpired:
            print(f"ray-head: `ray start` did not stop within {STOP_S:g} s; killing the instance", flush=True)
    code = ray.poll()
    if not stopping.is_set():
        print(f"ray-head: `ray start` {procs.exit_text(code)}; killing what is left of the instance", flush=True)
    end = time.monotonic() + 5.0
    while procs.kill_session(os.getpid(), spare=os.getpid()) and time.monotonic() < end:
        time.sleep(0.05)
        ray.poll()
    return 0 if stopping.is_set() else 1


if __name__ == "__main__":
    sys.exit(main())

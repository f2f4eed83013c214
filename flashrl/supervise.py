"""``flashrl run CONFIG --supervise``: a run that outlives its controller.

    supervisor (this process: no model, no engine; a small asyncio loop that only waits)
      start:   Child.spawn("controller", flashrl run CONFIG [--set ...] [--resume])   own process group;
               the controller dies with the supervisor (procs.child_init), and its children with it
      wait:    the controller's exit, or SIGINT / SIGTERM to the supervisor
        exit 0            the run finished                                  -> done (exit 0)
        exit 130          stopped on purpose (its own Ctrl-C / SIGTERM)     -> done, nothing restarted
        exit 2            the config or the launcher cannot work            -> done (exit 2): a restart fails the same way
        SIGINT / SIGTERM  to the supervisor: passed on to the controller (checkpoint and stop), the ladder
                          SIGTERM -> SIGKILL after STOP_GRACE_S; nothing restarted          -> exit 130
        anything else     a death (OOM killer, SIGKILL, a crash): logged with its cause; what the dead
                          controller started and left behind is killed; after a backoff (2 s, doubling to
                          60 s with each quick death in a row; back to 2 s after a controller that
                          lived HEALTHY_S or wrote a checkpoint) the controller is started again with --resume (the latest checkpoint, its
                          unfinished rollouts continued; none yet: the run starts over), until
                          ``max_restarts`` restarts are spent                              -> exit 1
    runs/<name>/supervisor.log: one line per start, death and decision, each death with its cause.

Engines, trainer ranks, env and reward workers keep their own recovery inside the controller (engine
restarts, run.auto_resume); the supervisor covers the one process nobody else watches. On SLURM, run the
supervisor inside the allocation (a requeue still needs SLURM's own --requeue).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from flashrl.procs import PARENT_ENV, Child, backoff, child_init, exit_text, signal_group, tail

STOP_GRACE_S = 60.0  # after a stop signal: the controller's checkpoint-and-stop, then SIGKILL
BACKOFF_S = (2.0, 60.0)  # first wait before a restart, and its cap (doubling in between)
LEFTOVER_WAIT_S = 10.0  # a dead controller's children kill themselves (their watchdog); after this, we do
HEALTHY_S = 60.0  # a controller that lived this long before dying starts the backoff over


def streak_after(streak: int, lived_s: float, progressed: bool = False, healthy_s: float = HEALTHY_S) -> int:
    """Deaths in a row that count for the backoff: a controller that lived ``healthy_s`` or more before dying,
    or wrote a checkpoint (``progressed``), starts it over (1); a quick death that kept nothing adds one.
    Without this, a long run's every later death (one a day over a week) would wait the cap, however
    healthy the run was in between; a controller that cannot start still backs off to the cap."""
    return 1 if lived_s >= healthy_s or progressed else streak + 1


def latest_checkpoint(run_dir: Path) -> str:
    """What runs/<name>/checkpoints/latest names ("" when none): a new one means the controller kept progress."""
    with contextlib.suppress(OSError):
        return (run_dir / "checkpoints" / "latest").read_text().strip()
    return ""


def decide(code: int, stopping: bool, restarts: int, max_restarts: int) -> str:
    """What a controller's exit means: "done", "stopped", "refused", "restart" or "give-up"."""
    if stopping:
        return "stopped"
    if code == 0:
        return "done"
    if code == 130:
        return "stopped"
    if code == 2:
        return "refused"
    return "restart" if restarts < max_restarts else "give-up"


def leftovers(parent: int, proc: Path = Path("/proc")) -> list[int]:
    """Live processes that a (now dead) ``parent`` started with Child.spawn: their environment names it as
    FLASHRL_PARENT_PID. They kill themselves when their parent goes (procs.child_init); a stuck one is ours."""
    needle = f"{PARENT_ENV}={parent}".encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


class Supervisor:
    """Keeps ``flashrl run`` going; ``command(resume)`` is the controller's command line."""

    def __init__(self, command: Callable[[bool], Sequence[str]], log_path: Path, controller_log: Path,
                 max_restarts: int = 10, resume_first: bool = False, first_backoff_s: float = BACKOFF_S[0],
                 checkpoint: Callable[[], str] = lambda: "") -> None:
        self.command = command
        self.log_path = log_path
        self.controller_log = controller_log
        self.max_restarts = max_restarts
        self.resume_first = resume_first
        self.first_backoff_s = first_backoff_s
        self.checkpoint = checkpoint  # the latest checkpoint's name (latest_checkpoint): progress kept
        self.restarts = 0
        self.deaths: list[str] = []
        self._stop = asyncio.Event()

    def say(self, text: str) -> None:
        line = f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M:%S')} supervisor: {text}"
        print(line, file=sys.stderr, flush=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def request_stop(self, why: str) -> None:
        if not self._stop.is_set():
            self.say(f"{why}: stopping the run (the controller checkpoints and stops); nothing is restarted")
        self._stop.set()

    async def _reap(self, pid: int) -> None:
        """Kill whatever the dead controller started that is still there after LEFTOVER_WAIT_S."""
        end = time.monotonic() + LEFTOVER_WAIT_S
        left = leftovers(pid)
        while left and time.monotonic() < end:
            await asyncio.sleep(0.2)
            left = leftovers(pid)
        for p in left:
            signal_group(p, signal.SIGKILL)
        if left:
            self.say(f"killed {len(left)} process(es) the dead controller had started (pids {left})")

    async def run(self) -> int:
        resume = self.resume_first
        streak = 0  # quick deaths in a row (streak_after): the backoff's exponent
        while True:
            cmd = list(self.command(resume))
            kept = self.checkpoint()
            child = Child.spawn("controller", cmd, None)  # its output (the dashboard) is ours
            self.say(f"started the controller (pid {child.pid}, attempt {self.restarts + 1}"
                     f"{', --resume' if resume else ''}): {' '.join(cmd[2:])}")
            stop_wait = asyncio.ensure_future(self._stop.wait())
            exit_wait = asyncio.ensure_future(child.exited())
            await asyncio.wait({stop_wait, exit_wait}, return_when=asyncio.FIRST_COMPLETED)
            stopping = self._stop.is_set()
            if stopping and child.alive:
                signal_group(child.pid, signal.SIGTERM)  # the controller's own stop: step, checkpoint, children down
                if not await child.wait(STOP_GRACE_S):
                    self.say(f"the controller did not stop within {STOP_GRACE_S:.0f} s; killing it")
                await child.stop(grace_s=0.0, term_s=1.0, kill_s=5.0)
            code = await exit_wait
            stop_wait.cancel()
            await self._reap(child.pid)
            verdict = decide(code, stopping, self.restarts, self.max_restarts)
            cause = exit_text(code)
            if verdict == "done":
                self.say(f"the run finished (controller pid {child.pid} exited with code 0); "
                         f"{self.restarts} restart(s)")
                return 0
            if verdict in ("stopped", "refused"):
                self.say(f"the controller (pid {child.pid}) {cause}: "
                         + ("stopped on purpose; not restarted" if verdict == "stopped"
                            else "the config or launcher cannot work; a restart would fail the same way"))
                return 130 if verdict == "stopped" else 2
            self.deaths.append(cause)
            last = tail(self.controller_log, 3).strip().replace("\n", " | ")
            if verdict == "give-up":
                self.say(f"death {len(self.deaths)}: the controller (pid {child.pid}) {cause}; restart budget "
                         f"({self.max_restarts}) spent, giving up. Last lines of {self.controller_log}: {last}")
                return 1
            self.restarts += 1
            streak = streak_after(streak, time.monotonic() - child.spawned_at, self.checkpoint() != kept)
            wait_s = backoff(streak, self.first_backoff_s, BACKOFF_S[1])
            self.say(f"death {len(self.deaths)}: the controller (pid {child.pid}) {cause}; restart "
                     f"{self.restarts} of {self.max_restarts} from the latest checkpoint in {wait_s:.0f} s. "
                     f"Last lines of {self.controller_log}: {last}")
            try:
                await asyncio.wait_for(self._stop.wait(), wait_s)
            except TimeoutError:
                pass
            if self._stop.is_set():
                return 130
            resume = True


def controller_command(config: Path, overrides: Sequence[str], run_dir: Path) -> Callable[[bool], list[str]]:
    """``flashrl run`` as the supervisor starts it: resume only when a checkpoint exists."""

    def command(resume: bool) -> list[str]:
        cmd = [sys.executable, "-m", "flashrl.cli", "run", str(config)]
        for s in overrides:
            cmd += ["--set", s]
        if resume and (run_dir / "checkpoints" / "latest").exists():
            cmd.append("--resume")
        return cmd

    return command


def main(config: Path, overrides: Sequence[str], run_dir: Path, max_restarts: int, resume: bool,
         first_backoff_s: float = BACKOFF_S[0]) -> int:
    """Supervise a run to its end; the process exit code (0 finished, 1 gave up, 2 refused, 130 stopped)."""
    child_init("flashrl supervise")  # started by a test or a bench: die with it
    sup = Supervisor(controller_command(config, overrides, run_dir), run_dir / "supervisor.log",
                     run_dir / "logs" / "controller.log", max_restarts, resume, first_backoff_s,
                     checkpoint=lambda: latest_checkpoint(run_dir))

    async def go() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, sup.request_stop, f"got {signal.Signals(sig).name}")
        return await sup.run()

    return asyncio.run(go())

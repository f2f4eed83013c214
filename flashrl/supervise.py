"""``flashrl run CONFIG --supervise``: a run that outlives its controller.

    supervisor (this process: no model, no engine; a small asyncio loop that only waits)
      start:   Child.spawn("controller", flashrl run CONFIG [--set ...] [--resume])   own process group;
               the controller dies with the supervisor (procs.child_init), and its children with it
      wait:    the controller's exit, or SIGINT / SIGTERM to the supervisor
        exit 0            the run finished                                  -> done (exit 0)
        exit 130          stopped on purpose (its own Ctrl-C / SIGTERM)     -> done, nothing restarted
        exit 2            the config or the launcher cannot work            -> done (exit 2): a restart fails the same way
        exit 3            a failure final by its nature (FINAL_EXIT in launch/driver.py: JudgeDown,
                          AdapterRefused): named from runs/<name>/failure.json    -> done (exit 3), not restarted
        SIGINT / SIGTERM  to the supervisor: passed on to the controller (checkpoint and stop), the ladder
                          SIGTERM -> SIGKILL after STOP_GRACE_S; nothing restarted          -> exit 130
        anything else     a death (OOM killer, SIGKILL, a crash): logged with its cause; what the dead
                          controller started and left behind is killed; then the restart is planned by the
                          rule a resume uses (resuming.restart_plan: the checkpoint ``latest`` names, else
                          the newest complete step-N folder, with or without the pointer):
                            a complete checkpoint with steps left  -> --resume PATH to it
                            none                                   -> a fresh start (nothing to set aside)
                            one at run.steps (or run.max_time_s)   -> the run finished -> exit 0
                          after a backoff (2 s, doubling to 60 s with each quick death in a row; back to 2 s
                          after a controller that lived HEALTHY_S or wrote a checkpoint), until
                          ``max_restarts`` restarts are spent                              -> exit 1
                          A restart never sets saved progress aside: it runs with FLASHRL_SUPERVISED_RESTART,
                          and a fresh start that finds a complete checkpoint then refuses (exit 2, named)
                          instead of renaming checkpoints/ aside (launch/driver.py prepare_run_dir).
    runs/<name>/supervisor.log: one line per start, death and decision, each death with its cause.

Engines, trainer ranks, env and reward workers keep their own recovery inside the controller (engine
restarts, run.auto_resume); the supervisor covers the one process nobody else watches. On SLURM, run the
supervisor inside the allocation (a requeue still needs SLURM's own --requeue).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from flashrl.checkpoint import CheckpointError, list_checkpoints
from flashrl.config import load
from flashrl.launch.rundir import FAILURE_FILE, FINAL_EXIT, RESTART_ENV
from flashrl.procs import PARENT_ENV, Child, backoff, child_init, exit_text, signal_group, tail
from flashrl.resuming import RestartPlan, restart_plan

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
    """The newest step-N folder of runs/<name>/checkpoints ("" when none), with or without ``latest``: a new
    one means the controller kept progress (the backoff starts over)."""
    found = list_checkpoints(run_dir / "checkpoints")
    return found[-1][1].name if found else ""


def decide(code: int, stopping: bool, restarts: int, max_restarts: int) -> str:
    """What a controller's exit means: "done", "stopped", "refused", "final", "restart" or "give-up"."""
    if stopping:
        return "stopped"
    if code == 0:
        return "done"
    if code == 130:
        return "stopped"
    if code == 2:
        return "refused"
    if code == FINAL_EXIT:
        return "final"
    return "restart" if restarts < max_restarts else "give-up"


def failure_of(run_dir: Path, since: float) -> str:
    """The failure a controller recorded in runs/<name>/failure.json (launch/driver.py) at or after ``since``
    (a wall-clock time): "JudgeDown: every judge engine is down ..."; '' when none (a config error the
    command line refused before the run began says so on stderr)."""
    path = run_dir / FAILURE_FILE
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if path.stat().st_mtime >= since - 1.0:  # mtime granularity
            rec = json.loads(path.read_text())
            return f"{rec['error']}: {rec['message']}"
    return ""


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


def final_policy_note(run_dir: Path, plan: RestartPlan) -> str:
    """Where a finished run's policy is: final/ when written after its last checkpoint, else the command that
    writes it from that checkpoint (the controller died between the two)."""
    final = run_dir / "final"
    with contextlib.suppress(OSError):
        if final.is_dir() and final.stat().st_mtime >= Path(plan.checkpoint).stat().st_mtime:
            return f"its final policy is in {final}"
    return (f"{final} was not written after it: `flashrl export {run_dir} --step {plan.step} --out DIR` writes the "
            "policy of that checkpoint")


class Supervisor:
    """Keeps ``flashrl run`` going. ``command(plan)``: the controller's command line for a RestartPlan;
    ``plan()``: how a restart continues (resuming.restart_plan); ``run_dir``: runs/<name>."""

    def __init__(self, command: Callable[[RestartPlan], Sequence[str]], run_dir: Path,
                 plan: Callable[[], Awaitable[RestartPlan]], max_restarts: int = 10, resume_first: bool = False,
                 first_backoff_s: float = BACKOFF_S[0]) -> None:
        self.command = command
        self.run_dir = run_dir
        self.log_path = run_dir / "supervisor.log"
        self.controller_log = run_dir / "logs" / "controller.log"
        self.plan = plan
        self.max_restarts = max_restarts
        # the first start does what the user typed: --resume (the controller refuses when there is nothing to
        # resume, naming it) or a fresh start
        self.first = RestartPlan(action="resume", why="as asked") if resume_first else \
            RestartPlan(action="fresh", why="as asked (no --resume)")
        self.first_backoff_s = first_backoff_s
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

    async def _attempt(self, plan: RestartPlan) -> tuple[Child, int, bool]:
        """One controller, from its start to its exit (or to the stop the user asked): (it, its exit code,
        whether we were stopping it)."""
        cmd = list(self.command(plan))
        # a restart is the supervisor's, not the user's: it never sets a complete checkpoint aside (driver)
        env = dict(os.environ, **{RESTART_ENV: "1"}) if self.restarts else None
        child = Child.spawn("controller", cmd, None, env=env)  # its output (the dashboard) is ours
        self.say(f"started the controller (pid {child.pid}, attempt {self.restarts + 1}, {plan.describe()}): "
                 f"{' '.join(cmd[2:])}")
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
        return child, code, stopping

    def _ended(self, verdict: str, child: Child, cause: str, started: float) -> int:
        """The supervisor's exit code for a controller that ended the run (done, stopped, refused, final)."""
        if verdict == "done":
            self.say(f"the run finished (controller pid {child.pid} exited with code 0); {self.restarts} restart(s)")
            return 0
        if verdict == "stopped":
            self.say(f"the controller (pid {child.pid}) {cause}: stopped on purpose; not restarted")
            return 130
        failure = failure_of(self.run_dir, started)
        what = f" ({failure})" if failure else ""
        if verdict == "final":
            self.say(f"the controller (pid {child.pid}) {cause}: a final failure{what}; a restart would fail "
                     "the same way: not restarted")
            return FINAL_EXIT
        self.say(f"the controller (pid {child.pid}) {cause}: the config or launcher cannot work{what}; a restart "
                 "would fail the same way: not restarted")
        return 2

    async def _next(self, child: Child, cause: str) -> RestartPlan | int:
        """After a death: how the run continues (restart_plan), or the supervisor's exit code (finished: 0)."""
        try:
            plan = await self.plan()
        except CheckpointError as e:  # e.g. an unreadable ``latest``: a resume would refuse it too
            self.say(f"death {len(self.deaths)}: the controller (pid {child.pid}) {cause}; cannot plan the "
                     f"restart: {e}")
            return 2
        if plan.action == "finished":
            policy = final_policy_note(self.run_dir, plan)
            self.say(f"the run finished at step {plan.step} ({plan.checkpoint}), though its controller (pid "
                     f"{child.pid}) {cause} after that checkpoint; not restarted; {policy}; {self.restarts} restart(s)")
            return 0
        return plan

    async def run(self) -> int:
        plan = self.first
        streak = 0  # quick deaths in a row (streak_after): the backoff's exponent
        while True:
            kept, started = latest_checkpoint(self.run_dir), time.time()
            child, code, stopping = await self._attempt(plan)
            verdict = decide(code, stopping, self.restarts, self.max_restarts)
            cause = exit_text(code)
            if verdict not in ("restart", "give-up"):
                return self._ended(verdict, child, cause, started)
            self.deaths.append(cause)
            nxt = await self._next(child, cause)
            if isinstance(nxt, int):
                return nxt
            plan = nxt
            last = tail(self.controller_log, 3).strip().replace("\n", " | ")
            if verdict == "give-up":
                self.say(f"death {len(self.deaths)}: the controller (pid {child.pid}) {cause}; restart budget "
                         f"({self.max_restarts}) spent, giving up. Last lines of {self.controller_log}: {last}")
                return 1
            self.restarts += 1
            streak = streak_after(streak, time.monotonic() - child.spawned_at, latest_checkpoint(self.run_dir) != kept)
            wait_s = backoff(streak, self.first_backoff_s, BACKOFF_S[1])
            self.say(f"death {len(self.deaths)}: the controller (pid {child.pid}) {cause}; restart "
                     f"{self.restarts} of {self.max_restarts} in {wait_s:.0f} s, {plan.describe()}. "
                     f"Last lines of {self.controller_log}: {last}")
            try:
                await asyncio.wait_for(self._stop.wait(), wait_s)
            except TimeoutError:
                pass
            if self._stop.is_set():
                return 130


def controller_command(config: Path, overrides: Sequence[str]) -> Callable[[RestartPlan], list[str]]:
    """``flashrl run`` as the supervisor starts it for a RestartPlan: "resume" adds ``--resume`` (with the
    step-N folder the plan chose, so the command does what the log says), "fresh" adds nothing."""

    def command(plan: RestartPlan) -> list[str]:
        cmd = [sys.executable, "-m", "flashrl.cli", "run", str(config)]
        if plan.action == "resume" and plan.checkpoint:
            cmd.append(plan.checkpoint)
        for s in overrides:
            cmd += ["--set", s]
        if plan.action == "resume":
            cmd.append("--resume")
        return cmd

    return command


PLAN_TIMEOUT_S = 300.0  # the plan verifies checkpoints (torch's DCP metadata): seconds, minutes on a slow disk


async def plan_in_child(config: Path, overrides: Sequence[str], timeout_s: float = PLAN_TIMEOUT_S) -> RestartPlan:
    """resuming.restart_plan for the run, computed in a child process (``python -m flashrl.supervise plan``):
    verifying a checkpoint imports torch (~250 MB, seconds) that this small process should not keep for the
    rest of the run. CheckpointError when the plan cannot be made (its message says why and the fix)."""
    cmd = [sys.executable, "-m", "flashrl.supervise", "plan", str(config), *overrides]
    try:
        p = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"planning the restart took over {timeout_s:.0f} s ({' '.join(cmd[2:])})") from None
    out = p.stdout.decode(errors="replace").strip().splitlines()
    if p.returncode != 0 or not out:
        raise CheckpointError(f"planning the restart failed ({exit_text(p.returncode)}): "
                              f"{p.stderr.decode(errors='replace').strip()[-2000:]}")
    rec = json.loads(out[-1])
    if "error" in rec:
        raise CheckpointError(rec["error"])
    return RestartPlan(**rec)


def _plan_main(argv: Sequence[str]) -> int:
    """``python -m flashrl.supervise plan CONFIG [KEY=VALUE ...]``: the restart plan as one JSON line."""
    import msgspec

    cfg = load(Path(argv[0]), list(argv[1:]))
    try:
        rec: dict[str, object] = msgspec.to_builtins(restart_plan(cfg))
    except CheckpointError as e:
        rec = {"error": str(e)}
    print(json.dumps(rec), flush=True)
    return 0


def main(config: Path, overrides: Sequence[str], run_dir: Path, max_restarts: int, resume: bool,
         first_backoff_s: float = BACKOFF_S[0]) -> int:
    """Supervise a run to its end; the process exit code (0 finished, 1 gave up, 2 refused, 3 a final
    failure, 130 stopped)."""
    child_init("flashrl supervise")  # started by a test or a bench: die with it
    sup = Supervisor(controller_command(config, overrides), run_dir, lambda: plan_in_child(config, overrides),
                     max_restarts, resume, first_backoff_s)

    async def go() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, sup.request_stop, f"got {signal.Signals(sig).name}")
        return await sup.run()

    return asyncio.run(go())


if __name__ == "__main__":
    if sys.argv[1:2] == ["plan"]:
        sys.exit(_plan_main(sys.argv[2:]))
    sys.exit("usage: python -m flashrl.supervise plan CONFIG [KEY=VALUE ...]")

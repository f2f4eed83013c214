"""The import graph of flashrl/ and envs/ (AST, every import: module-level and inside functions).

Dependencies flow one way: each unit of ``LAYERS`` imports only units listed before it (and
itself); the units of one tuple are siblings that never import each other (engine and trainer
above all). No import cycle. ``flashrl.core`` is pure: nothing of flashrl, no sockets, torch,
tasks, threads or clocks. docs/design.md ("Layout") documents this order.

``KNOWN`` lists known violations, each with its reason (none today, issue 8): the test fails on any
other edge against the order, on any cycle that does not go through a known edge, and on a known
edge that no longer exists (then delete it from the list: the list only shrinks). flashrl never
imports ``envs`` at all, with or without a KNOWN entry.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("flashrl", "envs")

LAYERS: list[str | tuple[str, ...]] = [
    "flashrl.core",  # pure domain rules (staleness, meters, step records)
    "flashrl.env",  # the public environment API (Task, Env, EnvSuite, StepResult, EnvFailure): pure
    "flashrl.aio",  # the hot path's asyncio toolkit
    # the wire: messages, sockets, CURVE keys, torch.distributed stores, weight-bucket format (no role owns it)
    "flashrl.wire.trajectory",  # the trajectory record (buffer, checkpoint, trainer batch)
    "flashrl.wire.protocol",
    "flashrl.wire.transport",
    "flashrl.wire.keys",
    "flashrl.wire.rendezvous",
    "flashrl.wire.weights",
    "flashrl.wire",
    # services every role uses
    "flashrl.procs",
    "flashrl.workers",  # the worker-process pool (remote env workers, process rewards)
    "flashrl.logging_setup",
    "flashrl.config_errors",  # msgspec errors as key paths with the fix (config and env.params)
    "flashrl.distill.config",  # [distill]: a section owned by its package, read by flashrl.config
    "flashrl.plugins",
    "flashrl.moe.config",  # [moe] (its own section, in flashrl.config's Config)
    "flashrl.vision.config",  # [vision] (its own section, in flashrl.config's Config)
    "flashrl.config",
    "flashrl.configref",  # docs/configuration.md generated from the config structs
    "flashrl.deadlines",  # deadlines that scale with the model's size
    "flashrl.rewards",
    "flashrl.metrics",
    "flashrl.interfaces",
    "flashrl.checkpoint",  # the run's checkpoint folders and the controller's state in them
    "flashrl.resuming",  # which checkpoint a run resumes from, what it may change, its folder put back
    # the launchers (local, Ray, SLURM): where processes start, their addresses, CURVE keys; the
    # package minus its two upper modules below (processes, driver)
    "flashrl.launch",
    # Mixture-of-Experts: route packing and checks, engine route capture, trainer routing replay (torch, numpy)
    "flashrl.moe",
    # images as references, their tokens, the prompt's expansion, the trainer's pixels and model view: what the
    # three roles use of flashrl.vision (the rest of it, the model builder, is on flashrl.models below)
    ("flashrl.vision.images", "flashrl.vision.tokens"),
    ("flashrl.vision.processor", "flashrl.vision.batch", "flashrl.vision.model"),
    "flashrl.vision.prompts",
    # the three roles: never import each other (the controller sees the others through interfaces)
    ("flashrl.controller", "flashrl.engine", "flashrl.trainer"),
    ("flashrl.sim", "flashrl.models", "flashrl.dashboard", "flashrl.samples"),
    "flashrl.rewardmodel",  # reward models beside the verifier: built (on models), served in worker processes
    "flashrl.judge",  # a generative judge beside the verifier: built (on models), served by engine processes
    "flashrl.distill",  # on-policy distillation: teachers built (on models), served by engine processes
    "flashrl.vision",  # vision-language models: builtin:vlm (on models), images as references, checked on an engine
    "flashrl.envcheck",  # what validate checks of an environment beyond its params (builds the suite)
    "flashrl.doctor",  # `flashrl doctor --gpu`: the trainer, the weight sync and a built chat model, checked on a device
    "flashrl.launch.processes",  # the engine pool and trainer group of a run, started through a launcher
    "flashrl.launch.driver",  # `flashrl run`: the one entry of a run
    "flashrl.supervise",  # `flashrl run --supervise`: restarts a dead controller (a process, not an import of it)
    # `flashrl bench` (one package), and apart from it the TRL peer program it starts as a child process:
    # neither imports the other (the peer reproduces flashrl's run with TRL, it does not run flashrl's code)
    ("flashrl.bench", "flashrl.bench.peers.trl_grpo"),
    "flashrl.cli",
    "envs",  # plug-ins on flashrl's public environment API; flashrl never imports them
]

# Known violations, each edge with why it is still there: none left (issue 8). Shrink, never grow.
KNOWN: dict[tuple[str, str], str] = {}

IMPURE = {"asyncio", "socket", "selectors", "zmq", "torch", "threading", "multiprocessing", "subprocess",
          "concurrent", "time"}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for top in TOPS:
        for p in sorted((root / top).rglob("*.py")):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = p
    return mods


def _imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, other top-level modules imported) per module."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, set[str]] = {m: set() for m in mods}

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # ``from pkg import sub`` depends on pkg.sub; ``from mod import name`` on mod
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                if t.split(".")[0] in TOPS:
                    r = resolve(t)
                    assert r is not None, f"{p}: import of {t} resolves to no module of {TOPS}"
                    if r != m:
                        edges[m].add(r)
                else:
                    external[m].add(t.split(".")[0])
    return edges, external


def _unit(m: str) -> tuple[int, str] | None:
    """(layer index, unit) of module ``m``: the longest listed prefix."""
    best: tuple[int, str] | None = None
    for i, layer in enumerate(LAYERS):
        for unit in (layer,) if isinstance(layer, str) else layer:
            if (m == unit or m.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (i, unit)
    return best


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_module_has_a_place_in_the_layer_order() -> None:
    missing = [m for m in _modules() if m not in TOPS and _unit(m) is None]
    assert not missing, f"modules in no unit of LAYERS (tests/unit/test_imports.py): {missing}; add them where they belong"


def _violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, targets in sorted(edges.items()):
        ua = _unit(a)
        for b in sorted(targets):
            ub = _unit(b)
            if ua is None or ub is None or (a, b) in KNOWN:
                continue  # an unplaced module fails the test above
            if ub[1] == ua[1]:
                continue  # inside one unit (a package's own modules)
            if ub[0] < ua[0]:
                continue
            why = "siblings never import each other" if ub[0] == ua[0] else "an import against the layer order"
            bad.append(f"{a} -> {b}: {why} ({ua[1]} may use only units listed before it in LAYERS)")
    return bad


def test_imports_follow_the_layer_order() -> None:
    edges, _ = _imports(_modules())
    bad = _violations(edges)
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    edges, _ = _imports(_modules())
    for a, b in KNOWN:
        edges[a].discard(b)
    cycles = _cycles(edges)
    assert not cycles, f"import cycles (module-level or inside functions): {cycles}"


def test_known_exceptions_still_exist() -> None:
    edges, _ = _imports(_modules())
    gone = [e for e in KNOWN if e[1] not in edges.get(e[0], set())]
    assert not gone, f"fixed, so delete from KNOWN in tests/unit/test_imports.py: {gone}"


# Inside the controller (issue 26): each part imports only the parts before it. Shared types sit in
# types.py, so the buffer and the rollouts never import each other; the supervisor (deaths, restarts)
# sits below the publisher, which hands it the engines that fail a sync.
CONTROLLER_ORDER = ["types", "scheduler", "buffer", "cut", "context", "rollout", "group", "supervisor", "publisher", "ledger", "resume", "evals", "feed", "controller"]


def _controller_violations(edges: dict[str, set[str]]) -> list[str]:
    pre = "flashrl.controller."
    seen: set[str] = set()
    bad = []
    for name in CONTROLLER_ORDER:
        for dep in sorted(edges.get(pre + name, set())):
            if dep.startswith(pre) and dep.removeprefix(pre) not in seen:
                bad.append(f"{pre}{name} -> {dep}")
        seen.add(name)
    return bad


def test_controller_parts_import_in_one_direction() -> None:
    edges, _ = _imports(_modules())
    parts = {m.removeprefix("flashrl.controller.") for m in edges if m.startswith("flashrl.controller.")}
    assert parts == set(CONTROLLER_ORDER), f"controller modules not in CONTROLLER_ORDER (tests/unit/test_imports.py): {parts ^ set(CONTROLLER_ORDER)}"
    assert not _controller_violations(edges), "\n".join(_controller_violations(edges))
    # the checker sees a violation: the buffer importing the rollouts (for a type) is one
    assert _controller_violations({"flashrl.controller.buffer": {"flashrl.controller.rollout"}}) == [
        "flashrl.controller.buffer -> flashrl.controller.rollout"]


def _envs_imports(edges: dict[str, set[str]]) -> list[str]:
    """Edges from flashrl into envs/ (no exception: not even a KNOWN one)."""
    return [f"{a} -> {b}" for a, targets in sorted(edges.items()) if a.split(".")[0] == "flashrl"
            for b in sorted(targets) if b.split(".")[0] == "envs"]


def test_flashrl_never_imports_envs() -> None:
    """envs/ holds plug-ins on flashrl.env; flashrl loads them by import path (flashrl.plugins.BUILTIN_ENVS),
    exactly like a user's environment, never with an import statement."""
    edges, _ = _imports(_modules())
    bad = _envs_imports(edges)
    assert not bad, f"flashrl imports envs/ (load it by import path instead, flashrl/plugins.py): {bad}"


def test_core_is_pure() -> None:
    mods = _modules()
    edges, external = _imports(mods)
    for m in mods:
        for pure in ("flashrl.core", "flashrl.env"):
            if m == pure or m.startswith(pure + "."):
                ours = [b for b in edges[m] if not b.startswith(pure)]
                assert not ours, f"{m} imports {ours}: {pure} imports nothing of flashrl or envs"
                assert not (external[m] & IMPURE), \
                    f"{m} imports {sorted(external[m] & IMPURE)}: {pure} has no sockets, torch, tasks or clocks"


def test_the_wire_belongs_to_no_role() -> None:
    """flashrl.wire (messages, sockets, keys, stores, weight format) imports nothing of flashrl outside
    itself: engine, trainer, controller and launchers all speak it, none owns it."""
    edges, _ = _imports(_modules())
    wire = [m for m in edges if m == "flashrl.wire" or m.startswith("flashrl.wire.")]
    assert len(wire) >= 5
    for m in wire:
        outside = sorted(b for b in edges[m] if not (b == "flashrl.wire" or b.startswith("flashrl.wire.")))
        assert not outside, f"{m} imports {outside}: the wire imports no role, launcher or service of flashrl"


def test_the_checker_sees_what_it_must(tmp_path: Path) -> None:
    """The walk itself: imports inside functions and relative ones count; a cycle and an edge
    against the order (engine -> trainer) are found."""
    edges, _ = _imports(_modules())
    assert "flashrl.wire.weights" in edges["flashrl.engine.weights"]  # module level
    assert "flashrl.wire.weights" in edges["flashrl.trainer.worker"]  # inside a method
    files = {
        "flashrl/__init__.py": "",
        "flashrl/engine/__init__.py": "",
        "flashrl/engine/a.py": "def f():\n    from ..trainer import b\n",
        "flashrl/trainer/__init__.py": "",
        "flashrl/trainer/b.py": "import flashrl.engine.a\n",
        "flashrl/sim.py": "from envs.arithmetic import verify\n",
        "envs/__init__.py": "",
        "envs/arithmetic.py": "from flashrl.env import Task\n",
        "flashrl/env.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges, _ = _imports(_modules(tmp_path))
    assert edges["flashrl.engine.a"] == {"flashrl.trainer.b"} and edges["flashrl.trainer.b"] == {"flashrl.engine.a"}
    assert _cycles(edges) == [["flashrl.engine.a", "flashrl.trainer.b"]]
    assert _violations(edges) == [
        "flashrl.engine.a -> flashrl.trainer.b: siblings never import each other "
        "(flashrl.engine may use only units listed before it in LAYERS)",
        "flashrl.sim -> envs.arithmetic: an import against the layer order "
        "(flashrl.sim may use only units listed before it in LAYERS)",
        "flashrl.trainer.b -> flashrl.engine.a: siblings never import each other "
        "(flashrl.trainer may use only units listed before it in LAYERS)",
    ]
    assert _envs_imports(edges) == ["flashrl.sim -> envs.arithmetic"]
    assert _violations({"flashrl.core.x": {"flashrl.aio"}, "flashrl.aio": {"flashrl.core.x"}}) == [
        "flashrl.core.x -> flashrl.aio: an import against the layer order "
        "(flashrl.core may use only units listed before it in LAYERS)"]


def test_the_roles_see_launchers_only_through_their_interface() -> None:
    """The controller, the engine and the trainer get a launcher handed in (launch/processes.py builds it):
    of the launch package they import only its interface, launch.base (Proc, Launcher), never a concrete
    launcher (local, Ray, SLURM) or the modules that start a run."""
    edges, _ = _imports(_modules())
    roles = ("flashrl.controller", "flashrl.engine", "flashrl.trainer")
    bad = sorted((m, t) for m, ts in edges.items() if m.startswith(roles) for t in ts
                 if t.startswith("flashrl.launch") and t != "flashrl.launch.base")
    assert bad == [], bad


MAX_LINES = 600  # a module past this names why in its docstring: "Over 600 lines because ..."


def _long_modules(root: Path) -> list[str]:
    bad = []
    for p in sorted(root.rglob("*.py")):
        text = p.read_text()
        if text.count("\n") > MAX_LINES and "Over 600 lines because" not in (ast.get_docstring(ast.parse(text)) or ""):
            bad.append(f"{p}: {text.count(chr(10))} lines")
    return bad


def test_no_module_over_600_lines_without_its_reason(tmp_path: Path) -> None:
    """A module over 600 lines says in one docstring line why it is one module (issue 35); the ones that
    needed no reason were split instead (controller/rollout.py, trainer/worker.py)."""
    bad = _long_modules(Path(__file__).resolve().parents[2] / "flashrl")
    assert not bad, f"split these modules or give the reason in their docstring: {bad}"
    (tmp_path / "long.py").write_text('"""A long module."""\n' + "x = 1\n" * MAX_LINES)  # the checker sees one
    assert _long_modules(tmp_path) == [f"{tmp_path / 'long.py'}: {MAX_LINES + 1} lines"]

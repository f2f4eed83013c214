"""Environments (and rewards) by name or by reference: how flashrl finds code it does not ship.

    env.name = "arithmetic"                 a built-in: BUILTIN_ENVS maps it to "envs.arithmetic:ArithmeticSuite"
    env.name = "my_math"                    an entry point of the group "flashrl.envs" (a pip-installed plug-in:
                                            [project.entry-points."flashrl.envs"] my_math = "my_pkg.envs:MathSuite")
    env.name = "my_pkg.my_env:MySuite"      an import path (module:attribute)
    env.name = "./my_env.py:MySuite"        a file path (relative to the directory flashrl runs in), then :attribute

flashrl never imports ``envs/`` statically: the built-ins are import-path strings, loaded on demand
exactly like a user's class. A reference that cannot be loaded raises ``PluginError`` (a ValueError)
whose message starts with the config key (``env.name: ...``) and says what could not be imported
and why (the module's own error, with the file and line it came from); ``flashrl validate``
reports it with exit code 2 before anything starts.

An environment class is an EnvSuite (flashrl/env.py): a ``Params`` msgspec Struct, ``train_tasks()``,
``eval_tasks()`` and ``make_env()``; it is built as ``cls(params, seed=..., eval_size=...)``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import msgspec

from flashrl.config_errors import describe

__all__ = [
    "BUILTIN_ENVS", "ENTRY_POINT_GROUP", "PluginError", "code_fingerprint", "entry_point_names", "env_name_problem",
    "load_object", "make_suite", "suite_class", "task_env", "warm_start_overrides",
]

# env.name -> "module:Class" of an EnvSuite. Strings, so that naming one imports none of the others.
BUILTIN_ENVS: dict[str, str] = {
    "arithmetic": "envs.arithmetic:ArithmeticSuite",
    "sim": "flashrl.sim.envs:SimSuite",  # simulated delays/failures for `flashrl bench`
    "countdown": "envs.countdown:CountdownSuite",
    "guess": "envs.guess:GuessSuite",  # multi-turn guessing game
    "code": "envs.code:CodeSuite",  # sandboxed code execution
    "remote": "envs.remote:RemoteSuite",  # any env in worker processes behind ZeroMQ
    "dataset": "envs.dataset:DatasetSuite",  # rows of a JSONL / Parquet / CSV file or a `datasets` folder
    "scratchpad": "envs.scratchpad:ScratchpadSuite",  # column addition written out: the long-tail task
    "tools": "envs.tools:ToolsSuite",  # multi-turn tool use: call a calculator, then answer
}
ENTRY_POINT_GROUP = "flashrl.envs"
_SUITE_METHODS = ("train_tasks", "eval_tasks", "make_env")


class PluginError(ValueError):
    """A reference (env.name, a reward) that cannot be loaded; the message names the key and why."""


def is_reference(ref: str) -> bool:
    """``module:attr`` or ``path/file.py:attr`` (not a bare name)."""
    return ":" in ref


def _where(e: BaseException) -> str:
    """' (at file:line)' of the innermost frame that raised ``e``, when there is one."""
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    return f" (at {f.filename}:{f.lineno})"


def _import_file(target: str, key: str) -> Any:
    p = Path(target).expanduser()
    if not p.is_absolute():
        p = Path.cwd() / p
    if not p.is_file():
        raise PluginError(f"{key}: file {target!r} not found (looked at {p}; a relative path is relative to "
                          f"the directory flashrl runs in, {Path.cwd()})")
    name = "flashrl_user_" + re.sub(r"\W", "_", str(p.resolve().with_suffix("")))
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__file__", None) == str(p):
        return mod
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise PluginError(f"{key}: {p} is not a Python file Python can import (expected a .py file)")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses / pickling-free self references need it registered
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        del sys.modules[name]
        raise PluginError(f"{key}: importing {p} failed: {type(e).__name__}: {e}{_where(e)}") from e
    return mod


def _import_module(module: str, key: str) -> Any:
    # As `python -m` does: the directory flashrl runs in is importable (examples.my_reward:fn).
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise PluginError(f"{key}: cannot import module {module!r}: no module named {e.name!r} "
                              f"(is the package installed, or on PYTHONPATH? searched {cwd} too)") from e
        raise PluginError(f"{key}: importing module {module!r} failed: {type(e).__name__}: {e}{_where(e)}") from e
    except Exception as e:
        raise PluginError(f"{key}: importing module {module!r} failed: {type(e).__name__}: {e}{_where(e)}") from e


def load_object(ref: str, key: str) -> Any:
    """The object ``ref`` names: ``"pkg.mod:attr"`` or ``"./file.py:attr"`` (attr may be dotted)."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise PluginError(f"{key}: {ref!r} is not a reference; expected 'package.module:name' or './file.py:name'")
    if target.endswith(".py") or "/" in target or os.sep in target:
        mod = _import_file(target, key)
        where = target
    else:
        mod = _import_module(target, key)
        where = f"module {target!r}"
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(mod) if not n.startswith("_"))
            raise PluginError(f"{key}: {where} has no attribute {attr!r} (it defines: {', '.join(names[:30]) or 'nothing public'})")
        obj = getattr(obj, part)
    return obj


def entry_point_names() -> dict[str, str]:
    """Installed plug-ins: entry-point name -> its "module:attr" value, in the group ``flashrl.envs``."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def env_name_problem(name: str) -> str | None:
    """Why ``env.name`` cannot name an environment, checked without importing anything; None if it may."""
    if name in BUILTIN_ENVS or is_reference(name) or name in entry_point_names():
        return None
    plugins = sorted(entry_point_names())
    return (f"unknown environment {name!r}; expected a built-in ({', '.join(sorted(BUILTIN_ENVS))}), "
            f"an installed plug-in of the entry-point group {ENTRY_POINT_GROUP!r} ({', '.join(plugins) or 'none installed'}), "
            f"or your own class as 'package.module:Class' or './file.py:Class'")


def suite_class(name: str, key: str = "env.name") -> type:
    """The EnvSuite class ``name`` names (imported on demand); PluginError naming ``key`` (where the name is
    written: ``env.name``, or ``env.params.inner`` under the remote wrapper) if not."""
    if name in BUILTIN_ENVS:
        cls = load_object(BUILTIN_ENVS[name], key)
    elif is_reference(name):
        cls = load_object(name, key)
    else:
        eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        if name not in eps:
            raise PluginError(f"{key}: {env_name_problem(name)}")
        try:
            cls = eps[name].load()
        except Exception as e:
            raise PluginError(f"{key}: the plug-in {name!r} (entry point {eps[name].value!r} of group "
                              f"{ENTRY_POINT_GROUP!r}) failed to load: {type(e).__name__}: {e}{_where(e)}") from e
    if not isinstance(cls, type):
        raise PluginError(f"{key}: {name!r} names a {type(cls).__name__}, not an environment class")
    missing = [m for m in _SUITE_METHODS if not callable(getattr(cls, m, None))]
    params = getattr(cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, msgspec.Struct)):
        missing.append("Params (a msgspec.Struct of its [env.params])")
    if missing:
        raise PluginError(f"{key}: {cls.__module__}.{cls.__qualname__} is not an EnvSuite: it lacks {', '.join(missing)} "
                          "(see flashrl/env.py: EnvSuite)")
    return cls


def task_env(name: str, params: dict[str, Any], key: str = "env.name") -> tuple[type, dict[str, Any], str]:
    """(class, params, key) of the environment whose tasks ``name`` serves: ``name``'s own class, or, for a
    wrapper (a class with ``wrapped_env(params) -> (name, params, key)``, like ``remote``), what it wraps."""
    cls: Any = suite_class(name, key)
    hook = getattr(cls, "wrapped_env", None)
    if hook is None:
        return cls, params, key
    inner, inner_params, inner_key = hook(params)
    return task_env(inner, dict(inner_params), inner_key)


def warm_start_overrides(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The WarmStart fields ``env.name`` overrides for the built-in model (its suite's ``WARM_START``,
    flashrl.env.Demonstrating), as written; a wrapper suite (remote) answers for the suite it wraps.
    flashrl.models.warm_start_of checks them against WarmStart."""
    cls, _, _ = task_env(name, params)
    return dict(getattr(cls, "WARM_START", {}))


def code_fingerprint(name: str, params: dict[str, Any]) -> str:
    """A hash of the code of the environment whose tasks ``name`` serves (``task_env``): the source of the
    module that defines its class, of its base classes' modules, and of the modules beside it (same folder)
    that those import, directly or through one another. Docstrings, comments and layout are left out
    (the source's syntax tree is hashed), so only a change in what the code does gives another hash.
    The built-in model's cache key holds it: an edited ``demonstration()`` rebuilds the model."""
    cls, _, _ = task_env(name, params)
    files: set[Path] = set()
    for base in cls.__mro__:
        mod = sys.modules.get(base.__module__)
        if mod is not None and base.__module__.partition(".")[0] not in sys.stdlib_module_names:
            _module_files(mod, files)
    digest = hashlib.sha256()
    for f in sorted(files):
        digest.update(f.name.encode() + b"\0" + _normalized_source(f) + b"\0")
    return digest.hexdigest()[:16]


def _module_files(mod: Any, out: set[Path]) -> None:
    """``mod``'s source file, then (recursively) those of the modules in its folder that it refers to."""
    src = getattr(mod, "__file__", None)
    if not src or not src.endswith(".py"):
        return
    path = Path(src).resolve()
    if path in out:
        return
    out.add(path)
    for value in list(vars(mod).values()):
        try:
            name = value.__name__ if isinstance(value, type(sys)) else getattr(value, "__module__", None)
        except Exception:  # an object whose attribute lookup runs code of its own
            continue
        other = sys.modules.get(name) if isinstance(name, str) else None
        other_file = getattr(other, "__file__", None)
        if isinstance(other_file, str) and Path(other_file).resolve().parent == path.parent:
            _module_files(other, out)


_PARSE = threading.Lock()  # CPython 3.11's ast.parse in two threads at once can raise SystemError (a recursion-depth race)


def _normalized_source(path: Path) -> bytes:
    """``path``'s syntax tree without docstrings, as text (its bytes when it does not parse)."""
    raw = path.read_bytes()
    try:
        with _PARSE:  # two model builds at once (each fingerprints its environment's code) parse in turn
            tree = ast.parse(raw)
    except (SyntaxError, ValueError):
        return raw
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def make_suite(name: str, params: dict[str, Any], seed: int, eval_size: int, key: str = "env.name",
               prefix: str = "env.params") -> Any:
    """Build the EnvSuite ``name`` names; bad params raise ValueError naming ``<prefix>.<key>``, a name that
    does not load one naming ``key`` (the remote wrapper's inner env: env.params.inner, env.params.params)."""
    cls: Any = suite_class(name, key)
    # ``faults`` is reserved for every env: delays and injected faults around it (envs/faults.py).
    faults = params.get("faults")
    params = {k: v for k, v in params.items() if k != "faults"}
    try:
        p = msgspec.convert(params, cls.Params, strict=True)
    except msgspec.ValidationError as e:
        where, what = describe(str(e), cls.Params, prefix=prefix, owner=f"env {name!r}", extra_keys=("faults",))
        raise PluginError(f"{where}: {what}" if what.startswith("unknown key") else f"{where}: {what} (env {name!r})") from None
    suite = cls(p, seed=seed, eval_size=eval_size)
    if faults is not None:
        with_faults = load_object("envs.faults:with_faults", f"{prefix}.faults")
        try:
            suite = with_faults(suite, faults, seed)
        except ValueError as e:
            raise PluginError(str(e).replace("env.params.faults", f"{prefix}.faults")) from None
    return suite

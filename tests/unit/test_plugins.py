"""Environments by built-in name, import path, file path and entry point (flashrl/plugins.py), and the
errors a user sees when one cannot be loaded (`flashrl validate` exits 2 naming env.name)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashrl.cli import app
from flashrl.config import ConfigError, load
from flashrl.plugins import BUILTIN_ENVS, PluginError, make_suite, suite_class

# A complete user environment, outside flashrl and envs/: one prompt, reward 1 for "yes".
MY_ENV = '''
import msgspec
from flashrl.env import StepResult, Task

class Env:
    async def reset(self, task):
        return task.prompt
    async def step(self, action):
        return StepResult(reward=float(action == "yes"), done=True)
    async def close(self):
        pass

class MySuite:
    class Params(msgspec.Struct, forbid_unknown_fields=True):
        n: int = 3
    def __init__(self, params, seed, eval_size):
        self.tasks = [Task(id=str(i), prompt=f"q{i}?", answer="yes") for i in range(params.n)]
    def train_tasks(self):
        return self.tasks
    def eval_tasks(self):
        return self.tasks[:1]
    def make_env(self):
        return Env()
'''


def write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(textwrap.dedent(text))
    return p


def validate(tmp: Path, env_name: str, params: str = "") -> tuple[int, str]:
    cfg = write(tmp, "c.toml", f'[env]\nname = "{env_name}"\n' + (f"[env.params]\n{params}\n" if params else ""))
    r = CliRunner().invoke(app, ["validate", str(cfg)])
    return r.exit_code, r.output


def test_builtins_are_import_paths_and_load() -> None:
    assert all(":" in ref for ref in BUILTIN_ENVS.values())
    assert suite_class("arithmetic").__name__ == "ArithmeticSuite"
    assert suite_class("envs.arithmetic:ArithmeticSuite") is suite_class("arithmetic")


def test_file_path_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "my_env.py", MY_ENV)
    monkeypatch.chdir(tmp_path)
    suite = make_suite("./my_env.py:MySuite", {"n": 5}, 0, 1)
    assert [t.prompt for t in suite.train_tasks()] == ["q0?", "q1?", "q2?", "q3?", "q4?"]
    code, out = validate(tmp_path, "./my_env.py:MySuite", "n = 2")
    assert code == 0, out
    code, out = validate(tmp_path, "./my_env.py:MySuite", "m = 2")  # its own Params checks its keys
    assert code == 2 and "env.params.m: unknown key" in out


def test_import_path_env_from_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "mypkg_byod"
    pkg.mkdir()
    write(pkg, "__init__.py", "")
    write(pkg, "envs.py", MY_ENV)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    suite = make_suite("mypkg_byod.envs:MySuite", {}, 0, 1)
    assert len(suite.train_tasks()) == 3


@pytest.mark.parametrize(
    ("name", "files", "expect"),
    [
        ("./nope.py:Suite", {}, r"env\.name: file './nope\.py' not found"),
        ("no_such_pkg_byod.mod:Suite", {}, r"env\.name: cannot import module 'no_such_pkg_byod\.mod': no module named 'no_such_pkg_byod'"),
        ("./broken.py:Suite", {"broken.py": "import json\nx = 1 / 0\n"}, r"env\.name: importing .*broken\.py failed: ZeroDivisionError: division by zero \(at .*broken\.py:2\)"),
        ("./deps.py:Suite", {"deps.py": "import not_installed_byod\n"}, r"No module named 'not_installed_byod'"),
        ("./ok.py:Suit", {"ok.py": MY_ENV}, r"env\.name: \./ok\.py has no attribute 'Suit' \(it defines: .*MySuite"),
        ("./plain.py:Thing", {"plain.py": "class Thing:\n    pass\n"}, r"env\.name: .*Thing is not an EnvSuite: it lacks train_tasks, eval_tasks, make_env, Params"),
        ("./fn.py:f", {"fn.py": "def f():\n    pass\n"}, r"env\.name: './fn\.py:f' names a function, not an environment class"),
    ],
)
def test_load_errors_say_what_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, files: dict[str, str], expect: str) -> None:
    for f, text in files.items():
        write(tmp_path, f, text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PluginError, match=expect):
        make_suite(name, {}, 0, 1)
    code, out = validate(tmp_path, name)  # caught by validate, before anything starts
    assert code == 2, out
    assert "config error" in out and "env.name" in out


def test_unknown_bare_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"env\.name: unknown environment 'nope'; expected a built-in \(.*dataset.*\), an installed plug-in"):
        load(write(tmp_path, "c.toml", '[env]\nname = "nope"\n'))


def _install_fake_dist(site: Path, module: str, body: str, entry: str) -> None:
    """What `pip install` of a package with a `flashrl.envs` entry point leaves on sys.path."""
    write(site, f"{module}.py", body)
    info = site / "byod_plugin-0.1.dist-info"
    info.mkdir()
    write(info, "METADATA", "Metadata-Version: 2.1\nName: byod-plugin\nVersion: 0.1\n")
    write(info, "entry_points.txt", f"[flashrl.envs]\n{entry}\n")


def test_entry_point_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install_fake_dist(site, "byod_plugin_mod", MY_ENV, "yesno = byod_plugin_mod:MySuite\nbroken = byod_plugin_mod:Missing")
    monkeypatch.syspath_prepend(str(site))
    cfg = load(write(tmp_path, "c.toml", '[env]\nname = "yesno"\n'))  # known without importing it
    suite = make_suite(cfg.env.name, {"n": 4}, 0, 1)
    assert [t.id for t in suite.train_tasks()] == ["0", "1", "2", "3"]
    with pytest.raises(PluginError, match=r"env\.name: the plug-in 'broken' \(entry point 'byod_plugin_mod:Missing' of group 'flashrl\.envs'\) failed to load: AttributeError"):
        make_suite("broken", {}, 0, 1)
    with pytest.raises(ConfigError, match=r"installed plug-in of the entry-point group 'flashrl\.envs' \(broken, yesno\)"):
        load(write(tmp_path, "d.toml", '[env]\nname = "yesn"\n'))


async def test_single_turn_env_base_keeps_the_task_and_judges_one_step() -> None:
    from flashrl.env import SingleTurnEnv, StepResult, Task

    class Echo(SingleTurnEnv):
        async def judge(self, task: Task, action: str) -> StepResult:
            return StepResult(reward=float(action == task.answer), done=True)

    env = Echo()
    with pytest.raises(RuntimeError, match=r"Echo\.step before reset: call reset\(task\) first"):
        await env.step("x")
    assert await env.reset(Task(id="t", prompt="say 7", answer="7")) == "say 7"
    assert (await env.step("7")).reward == 1.0 and (await env.step("8")).reward == 0.0
    await env.close()
    assert env.task is None
    bare = SingleTurnEnv()
    await bare.reset(Task(id="t", prompt="p"))
    with pytest.raises(NotImplementedError, match="judge"):
        await bare.step("a")

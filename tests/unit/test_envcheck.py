"""What `flashrl validate` checks of an environment beyond its params (flashrl/envcheck.py, flashrl/plugins.py):
the traps a new user writing a multi-turn tool environment from the docs met (issue 39): a misspelled
WARM_START key, a multi-turn env run with rollout.max_turns = 1, a bad `inner` under remote reported as
env.name, and a model cache that ignored the environment's code."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashrl.cli import app
from flashrl.config import Config, EnvConfig, ModelConfig, RolloutConfig
from flashrl.models import _cache_key, warm_start_of
from flashrl.models.tiny import TinySpec, WarmStart
from flashrl.plugins import PluginError, code_fingerprint

ROOT = Path(__file__).resolve().parents[2]

# A multi-turn lookup-tool environment as the docs teach it: a Demonstrating suite (its teacher calls the
# tool, then answers), no max_turns of its own. DEMO_CALL is the teacher's call; WARM is its WARM_START.
TOOL_ENV = '''
import msgspec
from flashrl.env import Demo, StepResult, Task

class LookupEnv:
    async def reset(self, task):
        self.task = task
        return task.prompt
    async def step(self, action):
        if action.startswith("get("):
            return StepResult(observation="=" + self.task.answer + "\\n", done=False)
        ok = action.strip() == self.task.answer
        return StepResult(reward=float(ok), done=True, info={"correct": ok})
    async def close(self):
        pass

class LookupSuite:
    """A docstring that may change freely."""
    WARM_START = WARM
    class Params(msgspec.Struct, forbid_unknown_fields=True):
        n: int = 8
    def __init__(self, params, seed, eval_size):
        self.tasks = [Task(id=str(i), prompt=f"k{i}?", answer=str(i * 7)) for i in range(params.n)]
    def train_tasks(self):
        return self.tasks
    def eval_tasks(self):
        return self.tasks[:2]
    def make_env(self):
        return LookupEnv()
    def demonstration(self, task, rng):
        return Demo(prompt=task.prompt, turns=[(DEMO_CALL, "=" + task.answer + "\\n"), (task.answer, "")])
'''


def tool_env(tmp: Path, name: str = "lookup.py", warm: str = '{"max_steps": 10}', call: str = '"get(" + task.id + ")"',
             extra: str = "") -> str:
    (tmp / name).write_text(textwrap.dedent(TOOL_ENV).replace("WARM_START = WARM", f"WARM_START = {warm}")
                            .replace("DEMO_CALL", call) + extra)
    return f"./{name}:LookupSuite"


def validate(tmp: Path, toml: str, *sets: str) -> tuple[int, str]:
    cfg = tmp / "c.toml"
    cfg.write_text(textwrap.dedent(toml))
    r = CliRunner().invoke(app, ["validate", str(cfg), *[a for s in sets for a in ("--set", s)]])
    return r.exit_code, r.output


# ------------------------------------------------------------------ 1. WARM_START keys
def test_a_misspelled_warm_start_key_fails_validate_naming_it_and_the_keys_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = tool_env(tmp_path, warm='{"max_step": 10}')
    toml = f'[env]\nname = "{env}"\n[rollout]\nmax_turns = 2\n'
    code, out = validate(tmp_path, toml)
    assert code == 2, out
    assert "LookupSuite.WARM_START.max_step: unknown key" in out and "did you mean `max_steps`?" in out
    assert "WARM_START accepts: max_steps, batch, lr, warmup, decay, target_accuracy, min_steps" in out
    assert out.startswith("config error: ") and "env.name: " in out
    # under the remote wrapper the same class is named where it is written: env.params.inner
    code, out = validate(tmp_path, f'[env]\nname = "remote"\n[env.params]\ninner = "{env}"\n[rollout]\nmax_turns = 2\n')
    assert code == 2 and "env.params.inner: " in out and "WARM_START.max_step: unknown key" in out, out
    # a wrong type too, and every built-in env's WARM_START is right
    tool_env(tmp_path, "typed.py", warm='{"batch": "32"}')
    with pytest.raises(PluginError, match=r"WARM_START\.batch: Expected `int`, got `str`"):
        warm_start_of("./typed.py:LookupSuite", {})
    for name in ("arithmetic", "guess", "tools", "scratchpad", "countdown"):
        warm_start_of(name, {})
    code, out = validate(tmp_path, toml.replace(env, tool_env(tmp_path, "good.py")))
    assert code == 0, out


# ------------------------------------------------------------------ 3. multi-turn env, rollout.max_turns = 1
def test_a_multi_turn_env_with_max_turns_1_fails_validate_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = tool_env(tmp_path)  # no max_turns of its own: its demonstrations take 2 turns
    code, out = validate(tmp_path, f'[env]\nname = "{env}"\n')  # rollout.max_turns defaults to 1
    assert code == 2, out
    assert "rollout.max_turns: env './lookup.py:LookupSuite' is multi-turn (an episode takes up to 2 turns, by its " \
           "demonstrations)" in out and "set max_turns = 2 in [rollout]" in out
    assert validate(tmp_path, f'[env]\nname = "{env}"\n[rollout]\nmax_turns = 2\n')[0] == 0
    # the remote wrapper is judged by what it wraps; a built-in that says its max_turns (tools: 3), by that
    code, out = validate(tmp_path, f'[env]\nname = "remote"\n[env.params]\ninner = "{env}"\n')
    assert code == 2 and "env 'remote' (inner './lookup.py:LookupSuite') is multi-turn" in out, out
    code, out = validate(tmp_path, (ROOT / "configs" / "tools.toml").read_text(), "rollout.max_turns=1")
    assert code == 2 and "up to 3 turns, by its max_turns" in out and "set max_turns = 3" in out, out
    # below the env's own limit but above 1: a warning, not a refusal
    code, out = validate(tmp_path, (ROOT / "configs" / "agentic.toml").read_text(), "rollout.max_turns=2")
    assert code == 0 and "warning: rollout.max_turns = 2 cuts the episodes of env 'guess', which take up to 4" in out, out
    # a single-turn env with the default is fine
    code, out = validate(tmp_path, '[env]\nname = "arithmetic"\n')
    assert code == 0 and "warning" not in out, out


# ------------------------------------------------------------------ 4. remote: errors name the right key
def test_remote_names_a_bad_inner_as_env_params_inner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for inner, expect in (("./missing.py:S", "env.params.inner: file './missing.py' not found (looked at "
                           f"{tmp_path / 'missing.py'}; a relative path is relative to the directory flashrl runs in"),
                          ("gues", "env.params.inner: unknown environment 'gues'")):
        code, out = validate(tmp_path, f'[env]\nname = "remote"\n[env.params]\ninner = "{inner}"\n')
        assert code == 2 and expect in " ".join(out.split()) and "env.name" not in out, out
    code, out = validate(tmp_path, '[env]\nname = "remote"\n[env.params]\ninner = "arithmetic"\n'
                                   '[env.params.params]\ndigitz = 2\n[env.params.params.faults]\nhang = 2.0\n')
    assert code == 2 and "env.params.params.digitz: unknown key for env 'arithmetic'" in out, out
    code, out = validate(tmp_path, '[env]\nname = "remote"\n[env.params]\ninner = "arithmetic"\n'
                                   '[env.params.params.faults]\nhang = 2.0\n')
    assert code == 2 and "env.params.params.faults" in out and "env.params.faults" not in out.replace(
        "env.params.params.faults", ""), out
    code, out = validate(tmp_path, '[env]\nname = "remote"\n[env.params]\ninner = "arithmetic"\n'
                                   '[env.params.params]\nops = ["+", "+"]\n')  # the inner suite's own check
    assert code == 2 and "env.params.params.ops: duplicate operators" in out, out


# ------------------------------------------------------------------ 2. the model cache covers the env's code
def _key(name: str, params: dict | None = None, **rollout: int) -> str:
    cfg = Config(model=ModelConfig(cache_dir="unused"), env=EnvConfig(name=name, params=params or {}),
                 rollout=RolloutConfig(**rollout))
    return _cache_key(cfg, TinySpec(), WarmStart())


def test_the_model_cache_key_covers_the_environments_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    a = tool_env(tmp_path, "a.py")
    b = tool_env(tmp_path, "b.py", call='"get(" + task.id + ") "')  # only demonstration() differs
    assert _key(a, max_turns=2) != _key(b, max_turns=2)
    # editing demonstration() in place, as a user does, changes the key; a docstring or comment does not
    before = _key(a, max_turns=2)
    tool_env(tmp_path, "a.py", call='"get(" + task.id + ")!"')
    edited = _key(a, max_turns=2)
    assert edited != before
    text = (tmp_path / "a.py").read_text().replace("A docstring that may change freely.", "Another docstring.")
    (tmp_path / "a.py").write_text(text + "\n# a comment\n")
    assert _key(a, max_turns=2) == edited
    # the remote wrapper's key covers the code it wraps
    assert code_fingerprint("remote", {"inner": a}) == code_fingerprint(a, {})
    # a module beside it that it uses is its code too
    (tmp_path / "helper_mod.py").write_text("def answer(i):\n    return str(i * 7)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    c = tool_env(tmp_path, "c.py", extra="\nfrom helper_mod import answer\n")
    before = code_fingerprint(c, {})
    (tmp_path / "helper_mod.py").write_text("def answer(i):\n    return str(i * 8)\n")
    assert code_fingerprint(c, {}) != before
    # a built-in env's key has its module's code: a different env module, a different fingerprint
    assert code_fingerprint("guess", {}) != code_fingerprint("tools", {})


def test_a_demonstrating_envs_key_has_the_rl_evals_turns_a_single_turn_ones_does_not() -> None:
    """The warm-start report plays its held-out episodes as the RL eval does (rollout.max_turns and
    max_new_tokens), so those are in the key of an env that demonstrates, and only there."""
    assert _key("guess", max_turns=4) != _key("guess", max_turns=3)
    assert _key("guess", max_turns=4, max_new_tokens=3) != _key("guess", max_turns=4, max_new_tokens=4)
    assert _key("arithmetic", max_turns=1, max_new_tokens=4) == _key("arithmetic", max_turns=2, max_new_tokens=8)


# ------------------------------------------------------------------ 7. the built-in tokenizer's characters
def test_text_outside_the_builtin_tokenizers_characters_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "curly.py").write_text(textwrap.dedent(TOOL_ENV).replace("WARM_START = WARM", "WARM_START = {}")
                                       .replace("DEMO_CALL", '"get{" + task.id + "}"'))
    code, out = validate(tmp_path, '[env]\nname = "./curly.py:LookupSuite"\n[rollout]\nmax_turns = 2\n')
    assert code == 0 and "the built-in model's tokenizer has no token for 2 character(s) its text uses: '{' " \
                         "(the demonstration of task '0'), '}'" in " ".join(out.split()), out

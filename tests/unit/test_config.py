"""Config loading: every problem is one ConfigError naming the key path; the CLI exits 2."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flashrl.config import Config, ConfigError, load, to_toml

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    """It loads, and every value the file sets is the value the run gets (none dropped or replaced)."""
    raw = tomllib.loads(path.read_text())
    assert _missing(raw, msgspec.to_builtins(load(path))) == []


def _missing(want: Any, got: Any, key: str = "") -> list[str]:
    """Where ``got`` (a loaded config, as plain data) differs from the file's ``want``: ``want``'s tables may
    leave keys out (defaults), every value it sets must be there as written."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{key}: a table in the file, {got!r} loaded"]
        return [m for k, v in want.items() for m in _missing(v, got.get(k, _ABSENT), f"{key}.{k}".lstrip("."))]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [m for i, (w, g) in enumerate(zip(want, got)) for m in _missing(w, g, f"{key}[{i}]")]
    return [] if got == want else [f"{key}: {want!r} in the file, {got!r} loaded"]


_ABSENT = object()


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load(ROOT / "configs" / "tiny.toml", ["rollout.group_size=4"])
    back = load(write(tmp_path, to_toml(cfg)))
    assert back == cfg
    assert back.rollout.group_size == 4


def test_defaults_without_file() -> None:
    assert load(None).rollout.group_size == Config().rollout.group_size


def test_unknown_key_names_path_and_suggests(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load(write(tmp_path, "[rollout]\ngrop_size = 4\n"))
    msg = str(e.value)
    assert "rollout.grop_size" in msg and "did you mean `group_size`" in msg


def test_unknown_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"bogus: unknown key; \[top level\] accepts: run, model"):
        load(write(tmp_path, "[bogus]\nx = 1\n"))


def test_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine\.count: Expected `int`, got `str`"):
        load(write(tmp_path, '[engine]\ncount = "two"\n'))


def test_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.group_size: Expected `int` >= 1"):
        load(write(tmp_path, "[rollout]\ngroup_size = 0\n"))


def test_bad_enum_lists_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.loss: invalid value 'pop'; expected one of: 'ppo'"):
        load(write(tmp_path, '[algorithm]\nloss = "pop"\n'))


def test_invalid_toml_names_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"invalid TOML: .*line 2"):
        load(write(tmp_path, "[run]\nsteps = = 3\n"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path / "nope.toml")


def test_unknown_env(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"env\.name: unknown environment 'nope'"):
        load(write(tmp_path, '[env]\nname = "nope"\n'))


def test_overrides_apply_and_parse_types(tmp_path: Path) -> None:
    cfg = load(None, ["rollout.temperature=0.5", "scheduler.queue_scheduling=false", "run.name=exp1"])
    assert cfg.rollout.temperature == 0.5
    assert cfg.scheduler.queue_scheduling is False
    assert cfg.run.name == "exp1"


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load(None, ["rollout.group_size"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size: Expected `int` >= 1"):
        load(None, ["rollout.group_size=-3"])


def test_nccl_on_cpu_rejected() -> None:
    with pytest.raises(ConfigError, match="trainer.backend: nccl needs GPUs"):
        load(None, ["trainer.backend=nccl", "engine.device=cpu"])


def test_env_params_errors_name_the_key() -> None:
    from envs import make_suite

    with pytest.raises(ValueError, match=r"env\.params\.bogus: unknown key for env 'guess'; \[env\.params\] accepts: max_number"):
        make_suite("guess", {"bogus": 1}, 0, 10)
    with pytest.raises(ValueError, match=r"env\.params\.digits: Expected `int`, got `str`"):
        make_suite("arithmetic", {"digits": "x"}, 0, 10)


def test_config_and_env_params_errors_come_from_one_formatter() -> None:
    """flashrl.config_errors.describe words both: the key path, the closest key, what the table accepts."""
    from flashrl.config import from_dict
    from flashrl.plugins import make_suite

    with pytest.raises(ConfigError, match=r"rollout\.group_sise: unknown key; did you mean `group_size`\? \[rollout\] accepts: "):
        from_dict({"rollout": {"group_sise": 3}})
    with pytest.raises(ValueError, match=r"^env\.params\.digitz: unknown key for env 'arithmetic'; did you mean `digits`\? "
                                         r"\[env\.params\] accepts: digits, ops, train_size, faults$"):
        make_suite("arithmetic", {"digitz": 2}, 0, 4)
    with pytest.raises(ConfigError, match=r"run\.dashboard: invalid value .nope.; expected one of: .auto., .rich."):
        from_dict({"run": {"dashboard": "nope"}})


def test_per_loss_options_live_in_their_table_and_belong_to_the_chosen_loss(tmp_path: Path) -> None:
    from flashrl.config import from_dict

    cfg = from_dict({"algorithm": {"loss": "cispo", "cispo": {"eps_high": 0.3}}})
    assert cfg.algorithm.cispo.eps_high == 0.3 and cfg.algorithm.cispo.eps_low == 1.0
    # an old-shape (flat) key names its new place
    with pytest.raises(ConfigError, match=r"algorithm\.cispo_eps_high: moved to \[algorithm\.cispo\] eps_high"):
        from_dict({"algorithm": {"loss": "cispo", "cispo_eps_high": 0.3}})
    with pytest.raises(ConfigError, match=r"algorithm\.critic_lr: moved to \[algorithm\.asyppo\] lr"):
        load(None, ["algorithm.critic_lr=0.01"])
    # options of another loss than the chosen one
    with pytest.raises(ConfigError, match=r"algorithm\.gspo: options of loss 'gspo', but algorithm\.loss = 'ppo'; "
                                          r"set algorithm\.loss = 'gspo' or remove \[algorithm\.gspo\]"):
        from_dict({"algorithm": {"loss": "ppo", "gspo": {"eps_low": 0.1}}})
    with pytest.raises(ConfigError, match=r"algorithm\.rhythm: options of the attention-rhythm credit, but algorithm\.credit"):
        from_dict({"algorithm": {"rhythm": {"window": 3}}})
    with pytest.raises(ConfigError, match=r"algorithm\.asyppo\.lrr: unknown key; did you mean `lr`\?"):
        from_dict({"algorithm": {"loss": "asyppo", "asyppo": {"lrr": 0.1}}})
    # the resolved config (every table, defaults included) reads back as itself
    p = tmp_path / "config.toml"
    p.write_text(to_toml(cfg))
    assert load(p) == cfg


def test_advice_warns_about_an_uncorrected_loss_on_async_samples() -> None:
    from flashrl.config import advice, load

    assert advice(load(None)) == []  # the defaults: decoupled_ppo corrects per token
    ppo = advice(load(None, ["algorithm.loss=ppo"]))
    assert len(ppo) == 1 and "'ppo'" in ppo[0] and "async_ratio = 2" in ppo[0] and "partial" in ppo[0]
    assert "decoupled_ppo" in ppo[0]  # the fix is named
    assert advice(load(None, ["algorithm.loss=ppo", "scheduler.async_ratio=0"])) == []  # sync: on-policy
    drop = advice(load(None, ["algorithm.loss=grpo", "scheduler.stale=drop"]))
    assert len(drop) == 1 and "partial" not in drop[0]
    assert advice(load(None, ["algorithm.loss=tis"])) == []


def test_checkpoint_writer_auto_takes_a_process_only_for_a_large_model() -> None:
    from flashrl.trainer.ckpt_writer import PROCESS_WRITER_MIN_BYTES, checkpoint_writer

    big, small = PROCESS_WRITER_MIN_BYTES // 4, PROCESS_WRITER_MIN_BYTES // 4 - 1
    # the same on the CPU and on CUDA (measured on an H200: the step beside a write +45% vs the thread's +171%)
    assert checkpoint_writer("auto", big) == "process"
    assert checkpoint_writer("auto", small) == "thread"  # the built-in model: its write takes milliseconds
    assert checkpoint_writer("process", small) == "process" and checkpoint_writer("thread", big) == "thread"


def _flat(tree: Any, key: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for name, sub in tree.items() for k, v in _flat(sub, f"{key}.{name}".lstrip(".")).items()}
    return {key: tree}


def test_sync_toml_is_tiny_toml_with_the_async_knobs_off() -> None:
    """configs/sync.toml, "the synchronous baseline", is tiny.toml's synchronous twin: the resolved configs
    differ only in the knobs `flashrl bench peers` sets for its sync runs (and the run's name)."""
    from flashrl.bench.peers.report import SYNC_SETS

    tiny = _flat(msgspec.to_builtins(load(ROOT / "configs/tiny.toml")))
    sync = _flat(msgspec.to_builtins(load(ROOT / "configs/sync.toml")))
    allowed = {s.split("=", 1)[0] for s in SYNC_SETS} | {"run.name"}
    assert tiny.keys() == sync.keys()
    differ = {k: (tiny[k], sync[k]) for k in tiny if tiny[k] != sync[k]}
    assert set(differ) - allowed == set(), f"sync.toml differs from tiny.toml beyond the async knobs: {differ}"
    # and those knobs are the synchronous ones, as the peers' sync runs set them
    twin = load(ROOT / "configs/tiny.toml", [*SYNC_SETS, f"run.name={sync['run.name']}"])
    assert _flat(msgspec.to_builtins(twin)) == sync
    assert sync["scheduler.async_ratio"] == 0 and sync["scheduler.queue_scheduling"] is False

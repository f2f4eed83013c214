"""The one way a parent hands a child its configuration (flashrl/wire/spec.py): a typed msgspec struct as
JSON in FLASHRL_SPEC, for engines (EngineSpec), trainer ranks (TrainerSpec) and env workers (EnvWorkerSpec)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from envs.remote import EnvWorkerSpec
from flashrl.config import Config, from_dict, load
from flashrl.engine.server import EngineSpec
from flashrl.trainer.spec import TrainerSpec
from flashrl.wire.spec import (
    MAX_SPEC_BYTES,
    SPEC_ENV,
    SpecError,
    decode_spec,
    encode_spec,
    read_spec,
    spec_env,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_trainer_spec_round_trips_every_shipped_config(path: Path) -> None:
    cfg = load(path)
    spec = TrainerSpec(cfg=cfg, address="tcp://10.0.0.2:5555", model="/models/m", resume="/runs/r/checkpoints/step-4")
    env = spec_env(spec)
    assert list(env) == [SPEC_ENV]
    back = read_spec(TrainerSpec, env)
    assert back == spec and back.cfg == cfg and type(back.cfg) is Config
    assert env == {}  # read once: the child's own children do not inherit it


def test_engine_and_env_worker_specs_round_trip() -> None:
    eng = EngineSpec(address="tcp://127.0.0.1:5", model="/m", name="engine3", dtype="bfloat16", device="cuda",
                     kv_cache_gib=0.25, threads=2, seed=9, gpu_memory_utilization=0.4, log_level="DEBUG")
    assert decode_spec(encode_spec(eng), EngineSpec) == eng
    worker = EnvWorkerSpec(address="ipc:///tmp/w0.sock", inner="guess", params={"delay": {"mean_s": 0.5}, "n": [1, 2]},
                           seed=3, eval_size=10)
    assert decode_spec(encode_spec(worker), EnvWorkerSpec) == worker


def test_non_default_config_values_survive() -> None:
    cfg = from_dict({"run": {"name": "x", "seed": 7}, "algorithm": {"loss": "cispo", "cispo": {"eps_high": 0.3}},
                     "env": {"name": "guess", "params": {"delay": {"mean_s": 0.125}}}, "trainer": {"lr": 3.5e-06}})
    back = decode_spec(encode_spec(TrainerSpec(cfg=cfg, address="a", model="m")), TrainerSpec).cfg
    assert back == cfg and back.algorithm.cispo.eps_high == 0.3 and back.trainer.lr == 3.5e-06


@pytest.mark.parametrize(("text", "match"), [
    ('{"address": "tcp://127.0.0.1:5"}', r"FLASHRL_SPEC: not a valid EngineSpec: Object missing required field `model`"),
    ('{"address": "a", "model": "/m", "max_num_seqs": "8"}', r"Expected `int`, got `str` - at `\$\.max_num_seqs`"),
    ('{"address": "a", "model": "/m", "max_model_len": 8}', r"Expected `int` >= 16 - at `\$\.max_model_len`"),
    ('{"address": "a", "model": "/m", "thread": 2}', r"not a valid EngineSpec: Object contains unknown field `thread`$"),
    ('{"address": "a", "model": ', r"FLASHRL_SPEC: not JSON \(.*\); expected its EngineSpec as JSON"),
])
def test_a_malformed_engine_spec_names_the_problem(text: str, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        read_spec(EngineSpec, {SPEC_ENV: text})


def test_a_malformed_trainer_spec_names_the_key_path() -> None:
    good = msgspec.json.decode(encode_spec(TrainerSpec(cfg=Config(), address="a", model="m")))
    good["cfg"]["trainer"]["ranks"] = 0
    with pytest.raises(SpecError, match=r"not a valid TrainerSpec: Expected `int` >= 1 - at `\$\.cfg\.trainer\.ranks`"):
        decode_spec(msgspec.json.encode(good).decode(), TrainerSpec)


def test_a_missing_spec_says_who_sets_it() -> None:
    with pytest.raises(SpecError, match=r"FLASHRL_SPEC is not set: python -m x reads its EngineSpec \(JSON\) from"):
        read_spec(EngineSpec, {}, who="python -m x")


def test_a_spec_json_cannot_carry_is_refused() -> None:
    with pytest.raises(SpecError, match="does not survive JSON unchanged"):
        encode_spec(EnvWorkerSpec(address="a", inner="guess", params={"x": float("nan")}))
    with pytest.raises(SpecError, match=f"over the {MAX_SPEC_BYTES}"):
        encode_spec(EnvWorkerSpec(address="a", inner="guess", params={"x": "y" * MAX_SPEC_BYTES}))

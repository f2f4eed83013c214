"""How a parent hands a child process its configuration: the one way, for every child flashrl starts.

    parent   env = spec_env(EngineSpec(...))                      JSON of a typed msgspec struct
             launcher.spawn("engine", i, ["python", "-m", "flashrl.engine.server"], env | ..., log)
    child    spec = read_spec(EngineSpec)                         decoded, validated, removed from os.environ

The children and their specs: engines (``flashrl.engine.server.EngineSpec``), trainer ranks
(``flashrl.trainer.spec.TrainerSpec``: the resolved Config, rank 0's address, the model, the resume
checkpoint), remote env workers (``envs.remote.EnvWorkerSpec``). Their command lines carry no options.

Why one environment variable (``FLASHRL_SPEC``) holding JSON:
- every launcher carries a child's environment to wherever it starts it (local: the Popen env; Ray:
  ``SpawnSpec.env`` to the node's actor; SLURM: the ``Spawn`` message to the node agent), so a child on
  another node needs no file in a shared run folder and no flag list written on one side and parsed
  on the other;
- msgspec checks every field's type and bounds on decoding; a bad spec is a ``SpecError`` naming the
  variable, the struct and the key path (``$.cfg.trainer.ranks``), never a half-configured child;
- JSON, not pickle: a spec is data, readable in ``/proc/<pid>/environ`` when debugging;
- the child removes the variable from ``os.environ`` once read, so its own children (vLLM's EngineCore,
  a sandboxed program) do not inherit it; tools that look for a child (tests, the chaos bench) read it
  from the kernel's copy with ``spec_in``.

``spec_env`` refuses a spec that JSON would not give back equal (a NaN or infinite float) and one
over ``MAX_SPEC_BYTES`` (Linux takes at most 128 KiB per environment string; a resolved config is
about 3 KiB). The CURVE keys never travel in a spec: the launcher passes their file's path
(``flashrl.wire.keys``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import TypeVar

import msgspec

SPEC_ENV = "FLASHRL_SPEC"
MAX_SPEC_BYTES = 64 * 1024

S = TypeVar("S", bound=msgspec.Struct)


class SpecError(RuntimeError):
    """A child's spec is missing, malformed, or does not fit its struct."""


def encode_spec(spec: msgspec.Struct) -> str:
    """``spec`` as the JSON text a child decodes back into an equal struct (SpecError otherwise)."""
    text = msgspec.json.encode(spec).decode()
    kind = type(spec)
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"{kind.__name__}: {len(text)} bytes of JSON, over the {MAX_SPEC_BYTES} a child's "
                        f"{SPEC_ENV} may hold; keep large data (datasets, weights) in files the spec names")
    try:
        back = msgspec.json.decode(text, type=kind)
    except msgspec.ValidationError as e:
        raise SpecError(f"{kind.__name__}: the spec does not validate against its own struct: {e}") from None
    if back != spec:
        raise SpecError(f"{kind.__name__}: the spec does not survive JSON unchanged (a NaN or infinite float?); "
                        "give finite values")
    return text


def spec_env(spec: msgspec.Struct) -> dict[str, str]:
    """The environment variable that carries ``spec`` to a child (merge it into the child's env)."""
    return {SPEC_ENV: encode_spec(spec)}


def decode_spec(text: str, kind: type[S]) -> S:
    """Decode ``text`` (JSON) into ``kind``; a SpecError names the problem and the key path."""
    try:
        return msgspec.json.decode(text, type=kind)
    except msgspec.ValidationError as e:
        raise SpecError(f"{SPEC_ENV}: not a valid {kind.__name__}: {e}") from None
    except msgspec.DecodeError as e:
        raise SpecError(f"{SPEC_ENV}: not JSON ({e}); expected its {kind.__name__} as JSON") from None


def read_spec(kind: type[S], environ: MutableMapping[str, str] | None = None, *, who: str = "this process") -> S:
    """This child's spec from ``FLASHRL_SPEC`` (removed from ``environ``, default ``os.environ``, once read)."""
    env = os.environ if environ is None else environ
    text = env.pop(SPEC_ENV, None)
    if text is None:
        raise SpecError(f"{SPEC_ENV} is not set: {who} reads its {kind.__name__} (JSON) from that environment "
                        "variable; flashrl's launchers set it (start runs with `flashrl run`)")
    return decode_spec(text, kind)


def read_spec_or_exit(kind: type[S], *, who: str, label: str) -> S:
    """``read_spec`` for a child's ``main()``: a missing or bad spec prints ``label: <the error>`` on
    stderr and exits with code 2 (nothing started)."""
    try:
        return read_spec(kind, who=who)
    except SpecError as e:
        print(f"{label}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def spec_in(environ: Mapping[str, str], kind: type[S]) -> S | None:
    """The spec a running child was started with, from its environment as the kernel keeps it
    (``psutil.Process(pid).environ()``, i.e. /proc/<pid>/environ: what execve gave it, unchanged by
    ``read_spec`` removing the variable from os.environ); None when it has none or one of another kind."""
    text = environ.get(SPEC_ENV)
    if text is None:
        return None
    try:
        return msgspec.json.decode(text, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None

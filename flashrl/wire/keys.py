"""Per-run ZeroMQ CURVE keys: one server key pair (every engine, trainer rank 0, env worker serves
with it) and one client key pair (the controller's), written once per run to a 0600 file.

    launcher.start()   CurveKeys.generate(run_dir/secrets/curve-keys.json)   (mode 0600, folder 0700)
    launcher.spawn()   env FLASHRL_CURVE_KEYS=<that path>   (never argv, never a log line)
    child              CurveKeys.from_env() -> RpcServer(curve=keys.server())  CURVE server + ZAP:
                                                                              only keys.client_public
    controller         RpcClient(curve=keys.client())
    launcher.close()   the file is removed

The secret halves never leave this file; ``repr`` shows the public keys only.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq

KEYS_ENV = "FLASHRL_CURVE_KEYS"


class KeyFileError(RuntimeError):
    """The key file is missing, unreadable, malformed, or readable by others."""


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)
    path: Path | None = None

    @classmethod
    def new(cls) -> CurveKeys:
        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        return cls(sp, ss, cp, cs)

    @classmethod
    def generate(cls, path: str | Path) -> CurveKeys:
        """Fresh keys written to ``path`` (0600; its folder 0700), replacing an earlier run's file."""
        return cls.new().write(path)

    def write(self, path: str | Path) -> CurveKeys:
        """Write these keys to ``path`` with mode 0600 (created that way: never readable by others)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path.parent, 0o700)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.to_bytes())
        return CurveKeys(self.server_public, self.server_secret, self.client_public, self.client_secret, path)

    def to_bytes(self) -> bytes:
        return json.dumps({k: getattr(self, k).decode() for k in
                           ("server_public", "server_secret", "client_public", "client_secret")}).encode()

    @classmethod
    def load(cls, path: str | Path) -> CurveKeys:
        path = Path(path)
        try:
            st = path.stat()
            raw = path.read_bytes()
        except OSError as e:
            raise KeyFileError(f"CURVE key file {path}: cannot read it ({e.strerror}); the launcher writes it "
                               f"at start and passes its path in {KEYS_ENV}") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(f"CURVE key file {path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it; "
                               "it must be 0600 (chmod 600)")
        try:
            d = json.loads(raw)
            keys = cls(server_public=d["server_public"].encode(), server_secret=d["server_secret"].encode(),
                       client_public=d["client_public"].encode(), client_secret=d["client_secret"].encode(), path=path)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise KeyFileError(f"CURVE key file {path}: malformed ({type(e).__name__}); delete it and restart the run") from None
        for k in ("server_public", "server_secret", "client_public", "client_secret"):
            if len(getattr(keys, k)) != 40:
                raise KeyFileError(f"CURVE key file {path}: {k} is not a 40-character Z85 key")
        return keys

    @classmethod
    def from_env(cls) -> CurveKeys | None:
        """The keys a launcher handed this process (FLASHRL_CURVE_KEYS), or None when it runs without CURVE."""
        path = os.environ.get(KEYS_ENV)
        return cls.load(path) if path else None

    def env(self) -> dict[str, str]:
        """The variable that hands these keys to a child (the path only)."""
        if self.path is None:
            raise KeyFileError("CURVE keys not written to a file yet (CurveKeys.write)")
        return {KEYS_ENV: str(self.path)}

    def server(self) -> dict[str, bytes]:
        """For transport.RpcServer(curve=...): serve with CURVE, accept only this run's client key."""
        return {"public": self.server_public, "secret": self.server_secret, "client_public": self.client_public}

    def client(self) -> dict[str, bytes]:
        """For transport.RpcClient(curve=...): the controller's key pair and the servers' public key."""
        return {"public": self.client_public, "secret": self.client_secret, "server_public": self.server_public}

    def remove(self) -> None:
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

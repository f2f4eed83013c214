"""The wire: everything that crosses a process boundary, owned by no role.

    trajectory.py  the trajectory record: one rollout, as the buffer keeps, a checkpoint saves and the trainer trains on it
    protocol.py    the msgspec messages (controller <-> engine, trainer, node agents); no pickle
    transport.py   ZeroMQ request/reply channels carrying them (CURVE off loopback), addresses, ports
    keys.py        the per-run CURVE keys (the file a launcher writes, the child reads)
    rendezvous.py  torch.distributed stores listening on the master address only
    weights.py     the weight sync's bucket format, checksums and group (trainer sends, engine receives)
    spec.py        a child's configuration at start: a typed struct as JSON in FLASHRL_SPEC

Engine, trainer, controller and the launchers all import this package; it imports none of them
(tests/unit/test_imports.py), so neither end of a channel owns its format.
"""

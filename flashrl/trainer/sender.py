"""Trainer rank 0's one weight sender: the versions it holds, the engines' groups, the sends in order.

    command loop --PrepareWeights(v)--> prepare(v, buckets)     (refused while a publication is sending)
                 --SendWeights(v)-----> send(v, peers): claims v here, in command order, then
                                          send thread: WeightSender.send(buckets) --> every engine's group
                 <--Future(Ok)--------- when the engines have the buckets (per-engine failures in its info)
                 --InitWeightSync-----> join(msg): join pool: one engine's group of two (blocks until it joins)
                 <--Future(Ok)---------
    RPC shell    --DropWeightPeer(p)--> drop(p): at once, not queued: a send waiting on p's group stops
                                          waiting (the engine is dead); p joins a new group when restarted

Sends run on one thread, apart from the command loop, so the next TrainStep trains while the engines
receive (weight_sync.overlap); one thread keeps them in command order among themselves. A claim holds
its own reference to the buckets, which nothing writes after build_manifest made them (new tensors),
so a later PrepareWeights cannot change what is being sent. Joins run on a pool of their own: a join
waits for its engine's rendezvous (up to its timeout), and a restarting engine that is slow to join
must not hold every other engine's sync.

Two versions are kept: the one prepared (not yet sent) and the one published (its buckets kept for a
restarted engine's catch-up: one host copy of the weights; on a GPU trainer that is GPU memory, see
docs/failures.md).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from flashrl.wire.protocol import InitWeightSync, Ok

Buckets = list[torch.Tensor]


class WeightPublisher:
    """Rank 0's weight versions and sends. ``prepare``, ``send``, ``check_prepare`` and ``join`` are
    called from one thread (the command loop), in command order; the returned futures complete on
    the sender's own threads."""

    def __init__(self) -> None:
        self.prepared: tuple[int, Buckets] | None = None
        self.published: tuple[int, Buckets] | None = None
        self.sender: Any = None  # trainer/weights.py WeightSender, made by the first join
        # versions whose first send (the publication) is in flight: a PrepareWeights meanwhile is refused
        self._publishing: set[int] = set()
        self._sending = 0  # sends submitted and not ended (publications and catch-ups)
        self._lock = threading.Lock()  # both: claimed on the command loop, released on the send thread
        self._sends: ThreadPoolExecutor | None = None
        self._joins: ThreadPoolExecutor | None = None

    def prepare(self, version: int, buckets: Buckets) -> None:
        self.prepared = (version, buckets)

    def drop_prepared(self) -> None:
        """Free the previous version's buckets before building new ones."""
        self.prepared = None

    def check_prepare(self, version: int) -> None:
        """Refuse PrepareWeights(``version``) while a publication is still sending (before the command fans
        out, so no rank starts the gather). The controller awaits a sync before preparing the next; this
        is the loud error should it ever not."""
        with self._lock:
            busy = min(self._publishing) if self._publishing else None
        if busy is not None:
            raise RuntimeError(f"PrepareWeights({version}) while SendWeights({busy}) is still "
                               "sending: the previous weight sync must finish before the next is prepared")

    def send(self, version: int, peers: list[str] | None = None) -> Future[Ok]:
        """Send ``version`` to ``peers`` (None: every joined engine) on the send thread: the version just
        prepared (it then becomes the published one) or the published one again (a restarted engine
        catching up). The claim is made here, at once (an error is this command's)."""
        if self.sender is None:
            raise RuntimeError("SendWeights before InitWeightSync: initialize the weight-sync group first")
        if self.prepared is not None and self.prepared[0] == version:
            buckets, publication = self.prepared[1], True
            self.published, self.prepared = self.prepared, None
        elif self.published is not None and self.published[0] == version:
            buckets, publication = self.published[1], False
        else:
            have = [v[0] for v in (self.prepared, self.published) if v is not None]
            raise RuntimeError(f"SendWeights({version}): prepared/published versions are {have}; "
                               f"send PrepareWeights({version}) first")
        if self._sends is None:
            self._sends = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-send")
        sender = self.sender
        with self._lock:
            self._sending += 1
            if publication:
                self._publishing.add(version)

        def run() -> Ok:
            try:
                seconds, failed = sender.send(buckets, peers)
            finally:
                self._done(version, publication)
            info = f"sent version {version} in {seconds:.3f}s"
            if failed:
                info += "; failed: " + "; ".join(f"{p}: {e}" for p, e in sorted(failed.items()))
            return Ok(info=info)

        try:
            return self._sends.submit(run)
        except RuntimeError:  # closed: nothing will send it
            self._done(version, publication)
            raise

    def _done(self, version: int, publication: bool) -> None:
        with self._lock:
            self._sending -= 1
            if publication:
                self._publishing.discard(version)

    def join(self, msg: InitWeightSync) -> Future[Ok]:
        """Join one engine's group (``msg.peer``) on the join pool, beside training and sends."""
        from flashrl.trainer.weights import WeightSender

        if msg.world_size != 2:
            raise ValueError(f"weight sync: one group of two per engine (trainer rank 0 + the engine); got world_size "
                             f"{msg.world_size}")
        if self.sender is None:
            self.sender = WeightSender()
        if self._joins is None:
            self._joins = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weight-sync-join")
        sender, peer = self.sender, msg.peer or "engine"

        def run() -> Ok:
            sender.join(peer, msg.master_addr, msg.master_port, msg.backend, msg.timeout_s)
            return Ok(info=f"weight sync: {peer} joined ({msg.backend})")

        return self._joins.submit(run)

    @property
    def busy(self) -> bool:
        """A send is in flight, or a broadcast left unfinished to a dropped peer (shutdown then does not
        wait for it)."""
        with self._lock:
            if self._sending > 0:
                return True
        return self.sender is not None and self.sender.stuck > 0

    def drop(self, peer: str) -> Ok:
        """``peer``'s engine is dead: a send stops waiting on it (WeightSender.drop). Any thread."""
        had = self.sender is not None and self.sender.drop(peer)
        return Ok(info=f"weight sync: {peer} dropped" if had else f"weight sync: {peer} had no group")

    def close(self) -> None:
        """Stop taking sends and joins; the one in flight is not waited for (its peer may be gone)."""
        for pool in (self._sends, self._joins):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._sends = self._joins = None

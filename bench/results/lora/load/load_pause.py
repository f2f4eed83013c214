"""The LoRA adapter load inside an engine's paused sync (engine/lora.py PolicyAdapter.load, what the engine
thread runs between two steps), timed alone on an in-process vLLM engine, for the code on PYTHONPATH:

    PYTHONPATH=<checkout> python bench/results/lora/load/load_pause.py MODEL_DIR [RANK] [N]

Per version: what the checkout does inside the pause. At 7feef93: the verified tensors' copy out of the
receive buffers (flashrl_take_weights' clone), the peft folder's write and ``add_lora``. After: the copy
and the folder's write (``PolicyAdapter.stage``) run beside generation, untimed here, and the pause runs
``add_lora`` alone. Prints one JSON line: median and max seconds over N versions after one warm-up, the
adapter's bytes, where the folders live, and whether the folder was staged before the pause."""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    model_dir, rank, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16, int(sys.argv[3]) if len(sys.argv) > 3 else 10
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from flashrl.engine import server
    from flashrl.engine.lora import PolicyAdapter, lora_engine_kwargs
    from flashrl.trainer.lora import LoraSpec, adapter_config, adapter_state_dict, apply_lora

    spec = LoraSpec(rank=rank, alpha=2 * rank)
    opts = server.EngineSpec(address="tcp://127.0.0.1:0", model=model_dir, max_model_len=64, max_num_seqs=8, kv_cache_gib=0.25)
    llm = LLMEngine.from_engine_args(EngineArgs(**server.engine_kwargs(opts), **lora_engine_kwargs(rank)),
                                     enable_multiprocessing=False)
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), spec)
    root = Path(tempfile.mkdtemp(prefix="lora-load-", dir=os.environ.get("LORA_ROOT")))
    adapter = PolicyAdapter(root, adapter_config(spec, model_dir))
    # at 7feef93 the server took the tensors out of the receive buffers inside the pause, and staged nothing
    take_in_pause = "flashrl_take_weights" in inspect.getsource(server.EngineServer._load_adapter)
    staged = callable(getattr(adapter, "stage", None))
    times = []
    for v in range(n + 1):
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
        tensors = adapter_state_dict(policy)
        if staged:  # beside generation, before the pause
            adapter.stage(v + 1, tensors)
        t0 = time.perf_counter()
        got = {k: t.clone() for k, t in tensors.items()} if take_in_pause else tensors
        adapter.load(llm, v + 1, got)
        if v:  # the first load is a warm-up
            times.append(time.perf_counter() - t0)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(json.dumps({"model": model_dir, "rank": rank, "versions": n, "adapter_bytes": nbytes,
                      "root": str(root.parent), "staged": staged, "take_in_pause": take_in_pause,
                      "median_s": round(statistics.median(times), 5), "max_s": round(max(times), 5)}))


if __name__ == "__main__":
    main()

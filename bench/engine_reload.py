"""What one weight load costs the CPU engine: vLLM's ``reload_weights`` of the built-in tiny model, alone.

    .venv/bin/python bench/engine_reload.py [--reloads 100] [--out bench/results/engine/reload.md]

Builds vLLM's ``LLMEngine`` in-process for configs/tiny.toml's model and engine arguments (``engine_kwargs``),
then, on its worker, reloads the model's own safetensors --reloads times exactly as a weight sync's load does
(``weights.load_into``: ``reload_weights`` + ``refresh_tied_layers``; no receive, no checksums) and reports the median and the spread.
Run it under ``py-spy record`` to see where a reload goes (on an AVX2 host: ~31% re-creating oneDNN's packed
GEMM handles, the rest vLLM's layer-wise reload bookkeeping).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reloads", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "bench/results/engine/reload.md"))
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # as the CPU engine runs
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # engine.threads = 1

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from flashrl.config import load
    from flashrl.engine.server import EngineSpec, engine_kwargs
    from flashrl.engine.weights import load_into
    from flashrl.models import ensure_model

    model = str(ensure_model(load(str(ROOT / "configs/tiny.toml"))))
    engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(
        EngineSpec(address="ipc://unused", model=model, max_model_len=64, kv_cache_gib=0.25))))
    reloads = args.reloads

    def reload_many(worker) -> list[float]:  # runs on the engine's worker (in this process)
        from safetensors.torch import load_file

        named = list(load_file(os.path.join(model, "model.safetensors")).items())
        times = []
        for _ in range(reloads):
            t = time.perf_counter()
            load_into(worker, named)
            times.append(time.perf_counter() - t)
        return times

    ms = sorted(1000 * t for t in engine.collective_rpc(reload_many)[0])
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    text = (f"# vLLM reload_weights of the built-in tiny model (CPU engine, 1 thread)\n\n"
            f"`.venv/bin/python bench/engine_reload.py --reloads {reloads}` on {cpu or 'this machine'}: "
            f"median {statistics.median(ms):.1f} ms, p10 {ms[len(ms) // 10]:.1f} ms, p90 {ms[9 * len(ms) // 10]:.1f} ms "
            f"per reload ({reloads} reloads).\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

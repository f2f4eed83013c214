"""vLLM's AsyncLLM (EngineCore in a spawned process) vs LLMEngine in-process, on the built-in tiny model.

    .venv/bin/python bench/engine_inproc.py [--waves 30] [--out bench/results/engine/inproc.md]

Each variant runs in a fresh child process (one after the other, same machine): start-up (engine
construction), the first wave of 128 seeded samples (8 prompts x 16, 4 new tokens, temperature 0.7,
sampled-token logprobs, token ids in and out: what a step of configs/tiny.toml asks for), then the
median wall time and the CPU time (the process and its children) per wave over --waves waves.
Variants: async (AsyncLLM, as the engine ran before engine/inproc.py), inproc (LLMEngine in-process),
inproc-nodynamo (the same with TORCHDYNAMO_DISABLE=1, as the CPU engine runs now).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(variant: str, model: str, waves: int) -> dict[str, float]:
    import asyncio

    import psutil

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.sampling_params import RequestOutputKind

    from flashrl.engine.server import EngineSpec, engine_kwargs

    # The engine's own arguments for configs/tiny.toml's engine (max_model_len 64, 0.25 GiB of KV cache).
    kw = engine_kwargs(EngineSpec(address="ipc://unused", model=model, max_model_len=64, kv_cache_gib=0.25))
    prompts = [[3 + (j * 7 + k) % 20 for k in range(8)] for j in range(8)]

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.7, max_tokens=4, seed=seed, logprobs=0, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def cpu() -> float:
        me = psutil.Process()
        return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])

    t0 = time.perf_counter()
    walls: list[float] = []
    if variant == "async":
        from vllm.v1.engine.async_llm import AsyncLLM

        eng = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        ready = time.perf_counter() - t0

        async def one(i: int, p: list[int]) -> None:
            async for _ in eng.generate(TokensPrompt(prompt_token_ids=p), params(i), str(i)):
                pass

        async def run_wave(base: int) -> float:
            t = time.perf_counter()
            await asyncio.gather(*[one(base + i, prompts[i // 16]) for i in range(128)])
            return time.perf_counter() - t

        async def main() -> tuple[float, float]:
            first = await run_wave(0)
            c0 = cpu()
            for w in range(waves):
                walls.append(await run_wave(1000 * (w + 1)))
            return first, cpu() - c0

        first, cpu_s = asyncio.run(main())
        eng.shutdown()
    else:
        from vllm.v1.engine.llm_engine import LLMEngine

        eng = LLMEngine.from_engine_args(EngineArgs(**kw))
        ready = time.perf_counter() - t0

        def run_wave(base: int) -> float:
            t = time.perf_counter()
            for i in range(128):
                eng.add_request(str(base + i), TokensPrompt(prompt_token_ids=prompts[i // 16]), params(base + i))
            while eng.has_unfinished_requests():
                eng.step()
            return time.perf_counter() - t

        first = run_wave(0)
        c0 = cpu()
        for w in range(waves):
            walls.append(run_wave(1000 * (w + 1)))
        cpu_s = cpu() - c0
    return {"ready_s": ready, "first_wave_ms": 1000 * first, "wave_ms": 1000 * statistics.median(walls),
            "cpu_per_wave_ms": 1000 * cpu_s / waves}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waves", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench/results/engine/inproc.md"))
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], args.waves)))
        return 0
    from flashrl.config import load
    from flashrl.models import ensure_model

    model = str(ensure_model(load(str(ROOT / "configs/tiny.toml"))))
    rows = {}
    for variant in ("async", "inproc", "inproc-nodynamo"):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("TORCHDYNAMO_DISABLE", None)
        if variant == "inproc-nodynamo":
            env["TORCHDYNAMO_DISABLE"] = "1"
        out = subprocess.run([sys.executable, __file__, "--waves", str(args.waves), "--child", variant, model],
                             env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(variant, rows[variant], flush=True)
    base = rows["async"]
    lines = ["# vLLM AsyncLLM vs LLMEngine in-process (built-in tiny model, 128 samples x 4 tokens per wave)", "",
             f"`.venv/bin/python bench/engine_inproc.py --waves {args.waves}`; one child process per variant, one "
             "after the other on this machine (2 cores; single runs move +-20%).", "",
             "| variant | engine ready | first wave | wave (median) | CPU per wave | wave vs async | CPU vs async |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for v, r in rows.items():
        lines.append(f"| {v} | {r['ready_s']:.1f} s | {r['first_wave_ms']:.0f} ms | {r['wave_ms']:.0f} ms | "
                     f"{r['cpu_per_wave_ms']:.0f} ms | {r['wave_ms'] / base['wave_ms']:.2f} | "
                     f"{r['cpu_per_wave_ms'] / base['cpu_per_wave_ms']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

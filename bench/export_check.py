"""An exported run folder decodes greedily the same in transformers and in the vLLM engine.

    .venv/bin/python bench/export_check.py EXPORTED [--prompts 4] [--max-tokens 16] [--out FILE.json]

``EXPORTED`` is a `flashrl export` folder. The engine is flashrl's own engine configuration (the
in-process ``LLMEngine`` with ``engine_kwargs``, as engine/server.py builds it, CPU, 1 thread), loading
the folder as `vllm serve` would; the run's last engine held the same weights (the final sync sends the
float32 weights exactly, and export writes the final state dict). Prompts are chat-template prompts; both
stop at the model's stop tokens (generation_config.json). Exit 1 if any prompt decodes differently.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PROMPTS = ["Guess a number between 1 and 9.", "What is 12 + 7?", "say hi", "Is 5 too high or too low?",
           "Write the total of 3 and 4.", "Find the hidden number."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("exported")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # as the CPU engine runs
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    from transformers import AutoModelForCausalLM

    from flashrl.engine.server import EngineSpec, engine_kwargs
    from flashrl.models.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tok = load_tokenizer(args.exported, "auto", "Find the hidden number.")
    prompts = [tok.encode_prompt(p) for p in PROMPTS[: args.prompts]]

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.exported, dtype=torch.float32, local_files_only=True)
    hf = []
    for p in prompts:
        got = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=args.max_tokens, do_sample=False)
        hf.append(got[0, len(p):].tolist())
    hf_s = time.perf_counter() - t0
    del model

    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(
        EngineSpec(address="ipc://unused", model=args.exported, max_model_len=256, kv_cache_gib=0.5))))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=tok.stop_token_ids)
    for k, p in enumerate(prompts):
        engine.add_request(f"g{k}", {"prompt_token_ids": p}, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    vllm = [outs[f"g{k}"] for k in range(len(prompts))]
    vllm_s = time.perf_counter() - t0

    same = [a == b for a, b in zip(hf, vllm)]
    result = {"exported": args.exported, "prompts": len(prompts), "max_tokens": args.max_tokens, "equal": same,
              "transformers": hf, "engine": vllm, "transformers_s": round(hf_s, 1), "engine_s": round(vllm_s, 1)}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"greedy outputs equal on {sum(same)} of {len(same)} prompts", file=sys.stderr)
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())

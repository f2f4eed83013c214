"""``python -m flashrl.vision.serve_check FOLDER PROMPT IMAGE...``: a real vLLM engine, built with the project's
EngineArgs (flashrl/engine/server.py ``engine_kwargs``: CPU, enforce_eager, no chunked prefill), generates on the
model ``FOLDER`` for the prompt text ``PROMPT`` (one ``<image>``) once per image file ``IMAGE``, the image as
vLLM's multimodal input; prints one JSON line per image: the prompt ids sent, the prompt ids vLLM served
(expanded), the sampled tokens with their logprobs, the seconds to build the engine and to serve the request.

Options (environment): ``FLASHRL_CHECK_SEED`` (request seed, 0), ``FLASHRL_CHECK_TOKENS`` (max new tokens, 8),
``FLASHRL_CHECK_TEMPERATURE`` (1.0), ``FLASHRL_CHECK_RELOAD`` (a model folder of the same architecture: after
the first round its model.safetensors is loaded into the running engine the way a weight sync loads
(flashrl/engine/weights.py ``load_into``: vLLM's reload_weights with the Hugging Face names, then the tied
layers), vision tower included, and every image is served again; those reports have ``"reloaded": true``). It is the feasibility check of flashrl/vision/__init__.py as a tool, and
tests/integration/test_vision_process.py runs it in a process of its own. The engine server's own path (Generate
with images over ZeroMQ) is tests/integration/test_vision_engine_process.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["serve"]


def _reload(worker: Any, path: str) -> int:
    """In vLLM's worker: load the safetensors file ``path`` as a weight sync does; the tensors loaded."""
    from safetensors.torch import load_file

    from flashrl.engine.weights import load_into

    named = load_file(path)
    load_into(worker, named.items())
    return len(named)


def serve(folder: str, prompt: str, images: list[str], seed: int = 0, max_tokens: int = 8,
          temperature: float = 1.0, reload: str = "") -> list[dict[str, Any]]:
    """Build the engine in this process, then serve ``prompt`` once with each image in turn (the same request
    seed: only the image differs); with ``reload`` (a folder), load its weights and serve each again. One
    report per request (the module docstring lists the keys)."""
    from flashrl.engine.server import EngineSpec, engine_kwargs
    from flashrl.vision.images import load_image

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, as the server runs it
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    pixels = [load_image(p, f"argument {i + 2}") for i, p in enumerate(images)]
    t0 = time.monotonic()
    spec = EngineSpec(address="tcp://127.0.0.1:0", model=folder, max_model_len=256, kv_cache_gib=0.1, max_num_seqs=4)
    llm = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(spec)), enable_multiprocessing=False)
    built = time.monotonic() - t0
    ids = list(llm.get_tokenizer().encode(prompt, add_special_tokens=False))
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, ignore_eos=True, seed=seed)
    reports = []
    rounds = [False, True] if reload else [False]
    for reloaded in rounds:
        if reloaded:
            llm.collective_rpc(_reload, args=(str(Path(reload) / "model.safetensors"),))
            llm.reset_prefix_cache()  # cached prompt blocks hold the old weights' keys and values
            # ... and cached vision embeddings the old vision tower's (vLLM reuses an image's encoder output
            # across requests by its hash): without this the same image is served stale (measured: issue 54)
            llm.reset_encoder_cache()
        for i, image in enumerate(pixels):
            t0 = time.monotonic()
            llm.add_request(f"check-{int(reloaded)}-{i}", TokensPrompt(prompt_token_ids=ids,
                                                                      multi_modal_data={"image": image}), params)
            done = []
            while llm.has_unfinished_requests():
                done += [o for o in llm.step() if o.finished]
            out = done[0].outputs[0]
            tokens = [int(t) for t in out.token_ids]
            reports.append({"image": images[i], "reloaded": reloaded, "prompt_ids": ids,
                            "served_prompt_ids": [int(t) for t in done[0].prompt_token_ids], "tokens": tokens,
                            "logprobs": [float(pos[t].logprob) for t, pos in zip(tokens, out.logprobs)],
                            "build_s": round(built, 3), "request_s": round(time.monotonic() - t0, 3)})
    return reports


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python -m flashrl.vision.serve_check FOLDER PROMPT IMAGE...", file=sys.stderr)
        return 2
    env = os.environ
    report = serve(argv[0], argv[1], argv[2:], seed=int(env.get("FLASHRL_CHECK_SEED", "0")),
                   max_tokens=int(env.get("FLASHRL_CHECK_TOKENS", "8")),
                   temperature=float(env.get("FLASHRL_CHECK_TEMPERATURE", "1.0")),
                   reload=env.get("FLASHRL_CHECK_RELOAD", ""))
    for line in report:
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

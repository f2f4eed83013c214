"""The reward-model worker process: ``python -m flashrl.rewardmodel.worker --model FOLDER``.

    stdin  (msgspec JSON lines)  ScoreBatch{texts}            one batch at a time
    stdout (msgspec JSON lines)  Ready{} first, then Scores{scores, refused, truncated} (one score per text, in
                                 order) or Scores{error}

Long texts: a text longer than the model takes (its max_position_embeddings; vLLM: its max_model_len) is cut
from the left to its last that many tokens (the response and the prompt's end are kept: the head reads the last
token), and counted (``truncated``; the client's env/rm_truncated). One bad text never fails the others: a
batch that raises is scored again text by text, and a text that fails alone is refused (``refused[i]`` says
why; its score is a 0.0 placeholder the client never gives out); only when every text fails alone is it the
batch's error (the model or the worker is broken: the client retries the batch).

``--runner`` says what serves the model:
- ``torch``: transformers' AutoModelForSequenceClassification (``--threads`` CPU threads, or ``--device cuda``);
  a batch is right-padded and each text's one logit returned.
- ``vllm``: vLLM's pooling runner (``LLM(runner="pooling")``, the classify task, no activation: the raw logit),
  in this process; vLLM batches the texts itself. vLLM serves ``*ForSequenceClassification`` of the causal
  LMs it knows (e.g. Llama, Qwen2) by converting their ``*ForCausalLM``.
- ``auto``: vllm, and torch when vLLM cannot load the folder on this device (an architecture it does not
  serve, a device it was not built for); Ready says which runs and why (the client logs it).
Both tokenize alike (no special tokens added) and score the same model: their scores agree to float
tolerance (tests/integration/test_rewardmodel_process.py). Nothing is pickled; the worker's own prints
go to stderr. It dies with its parent (flashrl.procs.child_init: parent-death signal, watchdog) and on
EOF of stdin.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from flashrl.procs import child_init

__all__ = ["Ready", "ScoreBatch", "Scores", "fit", "main", "score_each"]


class ScoreBatch(msgspec.Struct, kw_only=True):
    texts: list[str]


class Scores(msgspec.Struct, kw_only=True, omit_defaults=True):
    scores: list[float] = []
    error: str = ""
    refused: list[str] = []  # empty, or one per text: "" = scored, else why that text alone failed
    truncated: int = 0  # texts of the batch cut to the model's length


class Ready(msgspec.Struct, kw_only=True, omit_defaults=True):
    ready: bool = True
    error: str = ""
    pid: int = 0
    runner: str = ""  # what serves the model: "torch" | "vllm"
    note: str = ""  # runner auto: why vLLM does not serve it


Score = Callable[[list[str]], tuple[list[float], int]]  # texts -> (one score each, how many were truncated)


def fit(ids: list[list[int]], max_len: int) -> tuple[list[list[int]], int]:
    """Each id list cut to its last ``max_len`` ids; and how many were cut."""
    cut = sum(len(x) > max_len for x in ids)
    return ([x[-max_len:] for x in ids] if cut else ids), cut


def score_each(score: Score, texts: list[str]) -> Scores:
    """The batch's scores; when it raises, each text alone, so one bad text does not fail the rest (see the
    module doc); every text failing alone is the batch's error."""
    try:
        got, cut = score(texts)
        return Scores(scores=got, truncated=cut)
    except Exception as e:
        batch_error = f"{type(e).__name__}: {e}"
    if len(texts) == 1:
        return Scores(error=batch_error)
    scores: list[float] = []
    refused: list[str] = []
    truncated = 0
    for t in texts:
        try:
            one, cut = score([t])
            scores.append(one[0])
            refused.append("")
            truncated += cut
        except Exception as e:
            scores.append(0.0)
            refused.append(f"{type(e).__name__}: {e}")
    if all(refused):
        return Scores(error=batch_error)
    return Scores(scores=scores, refused=refused, truncated=truncated)


def torch_scorer(model: str, threads: int, device: str) -> Score:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flashrl.rewardmodel.build import pad_batch, text_ids

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model)
    net = AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32).to(device).eval()
    if tok.pad_token_id is None:
        raise ValueError(f"the tokenizer of {model} has no pad token; set one (tokenizer.pad_token) and save it")
    max_len = int(getattr(net.config, "max_position_embeddings", 0) or 1 << 30)

    def score(texts: list[str]) -> tuple[list[float], int]:
        ids, cut = fit(text_ids(tok, texts), max_len)
        inp, mask = pad_batch(tok, ids)
        with torch.no_grad():
            logits = net(input_ids=inp.to(device), attention_mask=mask.to(device)).logits
        return [float(x) for x in logits[:, 0].tolist()], cut

    return score


def vllm_scorer(model: str, device: str, kv_cache_gib: float, seed: int = 0) -> Score:
    """vLLM's pooling runner on ``model`` (float32 on cpu, as the torch runner; the model's dtype on cuda)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: it dies with the worker
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # as the policy's engines (engine/client.py)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its stderr is the run's: no per-load INFO lines
    from transformers import AutoTokenizer
    from vllm import LLM, PoolingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(model)
    kwargs: dict[str, Any] = {"distributed_executor_backend": "uni", "seed": seed}
    if device == "cpu":
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB; kv_cache_memory_bytes says it exactly
        kwargs.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)),
                      enable_chunked_prefill=False)
    llm = LLM(model=model, runner="pooling", **kwargs)
    raw = PoolingParams(use_activation=False)
    max_len = int(llm.model_config.max_model_len)  # a longer prompt vLLM refuses

    def score(texts: list[str]) -> tuple[list[float], int]:
        ids, cut = fit([tok.encode(t, add_special_tokens=False) or [tok.pad_token_id] for t in texts], max_len)
        out = llm.classify([TokensPrompt(prompt_token_ids=x) for x in ids], pooling_params=raw, use_tqdm=False)
        return [float(o.outputs.probs[0]) for o in out], cut

    return score


def load(ns: argparse.Namespace) -> tuple[Score, str, str]:
    """(score, the runner serving it, why not vLLM when auto fell back)."""
    if ns.runner == "torch":
        return torch_scorer(ns.model, ns.threads, ns.device), "torch", ""
    try:
        return vllm_scorer(ns.model, ns.device, ns.kv_cache_gib), "vllm", ""
    except Exception as e:
        if ns.runner == "vllm":
            raise
        why = f"vLLM's pooling runner cannot serve it here ({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})"
        return torch_scorer(ns.model, ns.threads, ns.device), "torch", why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="flashrl reward-model worker (started by flashrl.rewardmodel.client)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runner", choices=["torch", "vllm", "auto"], default="torch")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25)
    ns = ap.parse_args(argv)
    child_init("rm-worker")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rm-worker %(levelname)s %(message)s")
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # the protocol channel; everything else goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    enc = msgspec.json.Encoder()
    try:
        score, runner, note = load(ns)
    except Exception as e:
        out.write(enc.encode(Ready(ready=False, error=f"{type(e).__name__}: {e}")) + b"\n")
        return 1
    out.write(enc.encode(Ready(pid=os.getpid(), runner=runner, note=note)) + b"\n")
    dec = msgspec.json.Decoder(ScoreBatch)
    for line in sys.stdin.buffer:
        try:
            reply = score_each(score, dec.decode(line).texts)
        except Exception as e:  # a malformed batch is the caller's to handle; the worker stays up
            reply = Scores(error=f"{type(e).__name__}: {e}")
        out.write(enc.encode(reply) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

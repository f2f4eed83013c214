"""The reward-model worker process: ``python -m flashrl.rewardmodel.worker --model FOLDER``.

    stdin  (msgspec JSON lines)  ScoreBatch{texts}            one batch at a time
    stdout (msgspec JSON lines)  Ready{} first, then Scores{scores} (one per text, in order) or Scores{error}

It loads the folder with transformers' AutoModelForSequenceClassification (torch, ``--threads`` CPU threads,
or ``--device cuda``), right-pads a batch and returns each text's one logit. Nothing is pickled; the worker's
own prints go to stderr. It dies with its parent (flashrl.procs.child_init: parent-death signal, watchdog)
and on EOF of stdin. Why torch and not a vLLM pooling runner: on this project's CPU build of vLLM a second
vLLM process per reward model costs more CPU and memory than the few-ms forwards of a small model; the
client does not care which serves it (the wire is the same).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import msgspec

from flashrl.procs import child_init

__all__ = ["Ready", "ScoreBatch", "Scores", "main"]


class ScoreBatch(msgspec.Struct, kw_only=True):
    texts: list[str]


class Scores(msgspec.Struct, kw_only=True, omit_defaults=True):
    scores: list[float] = []
    error: str = ""


class Ready(msgspec.Struct, kw_only=True, omit_defaults=True):
    ready: bool = True
    error: str = ""
    pid: int = 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="flashrl reward-model worker (started by flashrl.rewardmodel.client)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ns = ap.parse_args(argv)
    child_init("rm-worker")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rm-worker %(levelname)s %(message)s")
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # the protocol channel; everything else goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    enc = msgspec.json.Encoder()
    try:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from flashrl.rewardmodel.build import encode_batch

        torch.set_num_threads(ns.threads)
        tok = AutoTokenizer.from_pretrained(ns.model)
        model = AutoModelForSequenceClassification.from_pretrained(ns.model, dtype=torch.float32).to(ns.device).eval()
        if tok.pad_token_id is None:
            raise ValueError(f"the tokenizer of {ns.model} has no pad token; set one (tokenizer.pad_token) and save it")
    except Exception as e:
        out.write(enc.encode(Ready(ready=False, error=f"{type(e).__name__}: {e}")) + b"\n")
        return 1
    out.write(enc.encode(Ready(pid=os.getpid())) + b"\n")
    dec = msgspec.json.Decoder(ScoreBatch)
    for line in sys.stdin.buffer:
        try:
            batch = dec.decode(line)
            inp, mask = encode_batch(tok, batch.texts)
            with torch.no_grad():
                logits = model(input_ids=inp.to(ns.device), attention_mask=mask.to(ns.device)).logits
            reply = Scores(scores=[float(x) for x in logits[:, 0].tolist()])
        except Exception as e:  # a bad batch is the caller's to handle; the worker stays up
            reply = Scores(error=f"{type(e).__name__}: {e}")
        out.write(enc.encode(reply) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

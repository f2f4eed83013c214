"""Does RL correct builtin:vlm's handicap? One-process GRPO on the digits env, no vLLM, no flashrl loop (issue 54).

    .venv/bin/python bench/vision_grpo.py --seed 0 [--steps 100] [--out bench/results/vision/grpo.jsonl]

Builds (or reads from --cache) builtin:vlm for envs/digits.py at the seed (flashrl/vision/build.py ensure_vlm:
the warm-start imitates a teacher that misreads 7 as 1 and 8 as 3 65% of the time), then runs plain on-policy
GRPO in this process with transformers: each step 8 train images x 8 answers sampled at temperature 1 (3
tokens, no KV cache), reward 1 when the verifier accepts, advantage = reward - its group's mean, one AdamW
step (lr --lr, gradient clipped at 1) on the sum of the answer's token logprobs times the advantage.
Held-out: the 30 held-out numbers drawn 4 times each at new offsets (120 images no train step saw),
greedy and one sample at temperature 1, at step 0 and every --every steps. Appends one JSON line per
evaluation to --out (seed, step, greedy, sampled, train reward, seconds, host).

This is a feasibility measurement of the task and the model, not of flashrl's RL loop: the engine's
Generate, the trainer's forward and the lineage do not carry images yet (flashrl/vision/__init__.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--cache", default=str(ROOT / ".cache/flashrl"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/vision/grpo.jsonl"))
    args = ap.parse_args()

    import torch

    from envs.digits import DigitsSuite, render, verify
    from flashrl.env import Task
    from flashrl.vision.batch import PixelCache, vision_inputs
    from flashrl.vision.build import ensure_vlm
    from flashrl.vision.images import png_bytes
    from flashrl.vision.processor import image_expansion, image_token_ids, load_processor
    from flashrl.vision.tokens import expand_images
    from flashrl.vision.warm import _accuracy

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    cfg = SimpleNamespace(model=SimpleNamespace(cache_dir=args.cache), run=SimpleNamespace(seed=args.seed),
                          env=SimpleNamespace(name="envs.digits:DigitsSuite", eval_size=30, params={}))
    folder = ensure_vlm(cfg)
    suite = DigitsSuite(DigitsSuite.Params(), seed=args.seed, eval_size=30)
    rng = random.Random(1000 + args.seed)
    held = [Task(id=f"{k}-{t.id}", prompt=t.prompt, answer=t.answer,
                 meta={"images": [png_bytes(render(t.answer, 64, 36, rng, 2))]})
            for k in range(4) for t in suite.eval_tasks()]
    proc = load_processor(folder)
    exp, tok = image_expansion(proc), proc.tokenizer
    image_id, eos = tok.convert_tokens_to_ids("<image>"), tok.eos_token_id
    banned = torch.tensor(image_token_ids(proc))  # an image token in an answer has no pixels behind it
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train, groups, size = list(suite.train_tasks()), 8, 8
    gen, pixels = torch.Generator().manual_seed(args.seed), PixelCache(proc)
    t0 = time.monotonic()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def record(step: int, reward: float | None) -> None:
        model.eval()
        line = {"seed": args.seed, "step": step, "greedy": _accuracy(model, proc, held, exp),
                "sampled": _accuracy(model, proc, held, exp, sample=torch.Generator().manual_seed(7)),
                "train_reward": reward, "seconds": round(time.monotonic() - t0, 1), "lr": args.lr,
                "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "model": folder.name}
        print(json.dumps(line), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")

    record(0, None)
    for step in range(1, args.steps + 1):
        tasks = [t for t in (train[rng.randrange(len(train))] for _ in range(groups)) for _ in range(size)]
        ids = torch.tensor([expand_images(tok.encode(t.prompt, add_special_tokens=False), image_id, exp) for t in tasks])
        kw = vision_inputs(pixels, [t.meta["images"] for t in tasks], [t.id for t in tasks])
        n = ids.shape[1]
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                last = model(input_ids=ids, **kw).logits[:, -1].index_fill(1, banned, float("-inf"))
                ids = torch.cat([ids, torch.multinomial(last.softmax(-1), 1, generator=gen)], 1)
        resp = ids[:, n:].tolist()
        ends = [r.index(eos) + 1 if eos in r else len(r) for r in resp]
        rewards = torch.tensor([float(verify(tok.decode(r[:e], skip_special_tokens=True), t.answer))
                                for r, e, t in zip(resp, ends, tasks)])
        mask = torch.tensor([[1.0 if k < e else 0.0 for k in range(len(r))] for r, e in zip(resp, ends)])
        adv = (rewards.view(groups, size) - rewards.view(groups, size).mean(1, keepdim=True)).view(-1)
        model.train()
        logits = model(input_ids=ids, **kw).logits[:, n - 1:-1]
        logp = torch.log_softmax(logits, -1).gather(2, ids[:, n:, None])[..., 0]
        loss = -((logp * mask).sum(1) * adv).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.every == 0 or step == args.steps:
            record(step, float(rewards.mean()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Can GRPO visibly improve the built-in tiny model on its built-in task within a few hundred steps?

One file, one process, no engines: the whole algorithm the real system distributes.

    ensure_model(cfg) -> warm-started model (cached)
    loop step = 1..steps:
        batch_prompts train tasks, each replicated group_size times
        sample with torch at `temperature` -> verify -> reward 0/1
          (from the weights of `lag` steps ago: the staleness async_ratio allows, like the real system)
        A_i = (r_i - mean_G r) / (std_G r + 1e-6)               (GRPO, per group, sample std)
        proximal logp = the weights at step start, raw (temperature 1) logits, no grad
        per mini-batch (contiguous groups, like trainer.mini_batches):
            L = -token-mean min(ratio A, clip(ratio) A), ratio = exp(logp - prox_logp)
            grad clip 1.0, AdamW step (lr linearly warmed up over `warmup` steps)
        every eval_every steps: greedy accuracy on the held-out split

This is what flashrl/trainer/worker.py does for loss = "ppo" (which ignores the behaviour logprobs).
Left out on purpose: importance weights, KL and entropy terms. This decides the defaults of
configs/tiny.toml (task difficulty, model size, lr, group size, ...), not the system.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/feasibility_grpo.py --steps 200 --lr 1e-4
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

from envs import make_suite
from envs.arithmetic import verify
from flashrl.config import Config, EnvConfig, ModelConfig, RunConfig
from flashrl.models import TinySpec, WarmStart, ensure_model, load_tokenizer
from flashrl.models.tiny import answer_tokens, generate, greedy_accuracy, left_pad


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default='{"digits": 2, "ops": ["+"]}', help="env.params as JSON")
    ap.add_argument("--eval-size", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--ws-target", type=float, default=WarmStart().target_accuracy, help="warm-start stops at this probe accuracy")
    ap.add_argument("--ws-lr", type=float, default=1e-3)
    ap.add_argument("--ws-max-steps", type=int, default=WarmStart().max_steps)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps (fresh AdamW's first steps are sign steps)")
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--batch-prompts", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0 = longest answer + EOS")
    ap.add_argument("--eps", type=float, default=0.2)
    ap.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per batch (trainer.mini_batches)")
    ap.add_argument("--lag", type=int, default=0, help="sample with the weights of this many steps ago (async staleness)")
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--ws-batch", type=int, default=64)
    ap.add_argument("--ws-slip", type=float, default=WarmStart().teacher_carry_slip, help="WarmStart.teacher_carry_slip")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--cache-dir", default=".cache/flashrl")
    ap.add_argument("--out", default="", help="write the curve and settings to this JSON file")
    return ap.parse_args(argv)


def _token_logps(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Per-token log-probs of each response given its prompt: (logp [B, T], mask [B, T])."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    ids, attn, pos = left_pad(seqs, pad_id)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1, :].float()
    logp_all = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    width = ids.shape[1]
    mask = torch.zeros_like(logp_all)
    for i, r in enumerate(responses):
        # response tokens sit at the last len(r) positions; token j is predicted from position j - 1
        mask[i, width - 1 - len(r):] = 1.0
    return logp_all, mask


def main(argv: list[str] | None = None) -> dict:
    a = _args(argv)
    torch.set_num_threads(1)
    params = json.loads(a.params)
    cfg = Config(run=RunConfig(seed=a.seed), env=EnvConfig(name="arithmetic", params=params, eval_size=a.eval_size),
                 model=ModelConfig(cache_dir=a.cache_dir))
    spec = TinySpec(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, intermediate=a.intermediate)
    warm = WarmStart(target_accuracy=a.ws_target, lr=a.ws_lr, max_steps=a.ws_max_steps, batch=a.ws_batch,
                     teacher_carry_slip=a.ws_slip)
    path = ensure_model(cfg, spec=spec, warm=warm)
    ws_report = json.loads((path / "flashrl_warmstart.json").read_text())
    print(f"model {path}: warm-start {ws_report['steps']} steps, held-out {ws_report['eval_accuracy']:.3f}, "
          f"{ws_report['seconds']:.0f} s", flush=True)

    from transformers import AutoModelForCausalLM

    suite = make_suite("arithmetic", params, seed=a.seed, eval_size=a.eval_size)
    train, held_out = list(suite.train_tasks()), list(suite.eval_tasks())
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, a.beta2))
    sampler = copy.deepcopy(model)  # holds the stale weights rollouts are sampled from when lag > 0
    history: collections.deque = collections.deque(maxlen=a.lag + 1)
    max_new = a.max_new_tokens or answer_tokens(train + held_out)
    rng = random.Random(a.seed)
    gen = torch.Generator().manual_seed(a.seed)

    model.eval()
    curve = [(0, greedy_accuracy(model, tok, held_out, max_new), 0.0)]
    print(f"step 0: held-out {curve[0][1]:.3f}", flush=True)
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        tasks = rng.sample(train, a.batch_prompts)
        prompts = [tok.encode(t.prompt) for t in tasks for _ in range(a.group)]
        model.eval()
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()} if a.lag else None)
        policy = model
        if a.lag:
            sampler.load_state_dict(history[0])  # the oldest kept: `lag` steps ago once warmed up
            policy = sampler.eval()
        responses = generate(policy, prompts, max_new, tok.eos_token_id, tok.pad_token_id, a.temperature, gen)
        rewards = torch.tensor([float(verify(tok.decode(r), tasks[i // a.group].answer))
                                for i, r in enumerate(responses)]).view(a.batch_prompts, a.group)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
        minis = torch.tensor_split(torch.arange(len(prompts)), a.mini_batches)
        with torch.no_grad():  # proximal logprobs: the weights at step start (the worker's prox)
            prox = [_token_logps(model, [prompts[i] for i in mb], [responses[i] for i in mb], tok.pad_token_id)[0]
                    for mb in minis]
        for group in opt.param_groups:
            group["lr"] = a.lr * (min(1.0, step / a.warmup) if a.warmup else 1.0)
        for mb, prox_lp in zip(minis, prox):
            logp, mask = _token_logps(model, [prompts[i] for i in mb], [responses[i] for i in mb], tok.pad_token_id)
            ratio = torch.exp((logp - prox_lp) * mask)
            A = adv[mb][:, None]
            loss_tok = -torch.minimum(ratio * A, ratio.clamp(1 - a.eps, 1 + a.eps) * A)
            loss = (loss_tok * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if step % a.eval_every == 0 or step == a.steps:
            model.eval()
            acc = greedy_accuracy(model, tok, held_out, max_new)
            curve.append((step, acc, round(time.perf_counter() - t0, 1)))
            print(f"step {step}: held-out {acc:.3f}  train reward {rewards.mean():.3f}  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    last3 = sum(c[1] for c in curve[-3:]) / len(curve[-3:])
    result = {"settings": vars(a), "warm_start": ws_report, "curve": curve, "gain_last3": last3 - curve[0][1],
              "gain": curve[-1][1] - curve[0][1], "best_gain": max(c[1] for c in curve) - curve[0][1]}
    print(f"gain (mean of last 3 evals) {result['gain_last3']:+.3f}, final {result['gain']:+.3f}, "
          f"best {result['best_gain']:+.3f} over {a.steps} steps", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

"""The warm-started built-in model's own rollouts on a long-tail config: response lengths and held-out accuracy.

    .venv/bin/python bench/longtail_warmstart.py [configs/longtail.toml] [--samples 4] [--out bench/results/longtail/warmstart.md]

Builds (or finds cached) the config's model (``flashrl init-model``), then samples ``--samples``
responses for each held-out prompt (``env.eval_size`` of them) through vLLM with the engine
arguments flashrl's own engine uses (flashrl.engine.server.engine_kwargs: CPU, eager, the config's
max_model_len and KV cache), at the config's ``rollout.temperature`` and ``rollout.max_new_tokens``,
seeded per request. Reports the generated length distribution (tokens, the end-of-sequence token
included as the engine counts it): p50, p90, p99, max and p99/p50, the share cut at max_new_tokens,
the sampled held-out accuracy (the env's verifier, what RL's reward sees) and the greedy one (what
``eval`` logs at eval_temperature 0), and both per problem size when the tasks carry ``meta["digits"]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pct(xs: list[int], q: float) -> int:
    """The q-quantile of ``xs`` (nearest rank, as numpy's 'lower')."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _score(suite, tasks, texts: list[str]) -> list[bool]:
    out = []
    for t, text in zip(tasks, texts):
        env = suite.make_env()
        await env.reset(t)
        res = await env.step(text)
        out.append(bool(res.info.get("correct", res.reward >= 1.0)))
        await env.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default=str(ROOT / "configs/longtail.toml"))
    ap.add_argument("--samples", type=int, default=4, help="samples per held-out prompt (default 4)")
    ap.add_argument("--set", action="append", default=[], help="config override, as flashrl's --set")
    ap.add_argument("--out", default="", help="also write the report (markdown) here")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from flashrl.config import load
    from flashrl.engine.server import EngineSpec, engine_kwargs
    from flashrl.models import ensure_model
    from flashrl.plugins import make_suite

    cfg = load(args.config, args.set)
    t0 = time.perf_counter()
    model = ensure_model(cfg)
    build_s = time.perf_counter() - t0
    report = json.loads((model / "flashrl_warmstart.json").read_text()) if (model / "flashrl_warmstart.json").is_file() else {}
    suite = make_suite(cfg.env.name, dict(cfg.env.params), seed=cfg.run.seed, eval_size=cfg.env.eval_size)
    tasks = list(suite.eval_tasks())

    from vllm import LLM, SamplingParams, TokensPrompt

    from flashrl.models import load_tokenizer

    tok = load_tokenizer(model)
    kw = engine_kwargs(EngineSpec(address="ipc://unused", model=str(model), max_model_len=cfg.model.max_model_len,
                                  kv_cache_gib=cfg.engine.kv_cache_gib, max_num_seqs=cfg.engine.max_num_seqs,
                                  seed=cfg.run.seed))
    kw.pop("worker_extension_cls", None)
    llm = LLM(**kw)
    prompts = [TokensPrompt(prompt_token_ids=tok.encode_prompt(t.prompt)) for t in tasks]
    t1 = time.perf_counter()
    sampled = llm.generate([p for p in prompts for _ in range(args.samples)],
                           [SamplingParams(temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_new_tokens,
                                           seed=cfg.run.seed * 1_000_003 + i)
                            for i in range(len(prompts) * args.samples)], use_tqdm=False)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=cfg.rollout.max_new_tokens), use_tqdm=False)
    gen_s = time.perf_counter() - t1

    s_tasks = [t for t in tasks for _ in range(args.samples)]
    s_lens = [len(o.outputs[0].token_ids) for o in sampled]
    s_cut = [o.outputs[0].finish_reason == "length" for o in sampled]
    s_ok = asyncio.run(_score(suite, s_tasks, [tok.decode(o.outputs[0].token_ids) for o in sampled]))
    g_ok = asyncio.run(_score(suite, tasks, [tok.decode(o.outputs[0].token_ids) for o in greedy]))

    p50, p90, p99 = _pct(s_lens, 0.5), _pct(s_lens, 0.9), _pct(s_lens, 0.99)
    lines = [
        f"# Warm-started model's own rollouts: {Path(args.config).name}",
        "",
        f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}` (at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Model: {model.name} (env {cfg.env.name}, params {dict(cfg.env.params)}, seed {cfg.run.seed}); "
        f"warm-start report: steps {report.get('steps')}, {report.get('seconds')} s, greedy held-out "
        f"{report.get('eval_accuracy')}, sampled (T=1) {report.get('eval_success_sampled')}"
        + (f"; this call built it in {build_s:.0f} s" if build_s > 5 else "; cached"),
        "",
        f"Sampled through vLLM (flashrl's engine arguments, CPU) at rollout.temperature={cfg.rollout.temperature}, "
        f"max_new_tokens={cfg.rollout.max_new_tokens}: {args.samples} samples x {len(tasks)} held-out prompts "
        f"in {gen_s:.1f} s (with the greedy pass).",
        "",
        "| generated tokens | p50 | p90 | p99 | max | mean | p99/p50 | cut at max_new_tokens |",
        "|---|---|---|---|---|---|---|---|",
        f"| sampled, all | {p50} | {p90} | {p99} | {max(s_lens)} | {statistics.mean(s_lens):.1f} | "
        f"**{p99 / p50:.2f}** | {sum(s_cut)}/{len(s_cut)} |",
        "",
        f"Held-out accuracy: sampled (T={cfg.rollout.temperature}) **{sum(s_ok) / len(s_ok):.3f}**, "
        f"greedy **{sum(g_ok) / len(g_ok):.3f}**.",
        "",
    ]
    if all("digits" in t.meta for t in tasks):
        by: dict[int, list[int]] = defaultdict(list)
        for i, t in enumerate(s_tasks):
            by[t.meta["digits"]].append(i)
        lines += ["| columns | held-out prompts | median tokens | max tokens | sampled acc | greedy acc |",
                  "|---|---|---|---|---|---|"]
        for d in sorted(by):
            idx = by[d]
            g_idx = [j for j, t in enumerate(tasks) if t.meta["digits"] == d]
            lines.append(f"| {d} | {len(g_idx)} | {statistics.median(s_lens[i] for i in idx):.0f} | "
                         f"{max(s_lens[i] for i in idx)} | {sum(s_ok[i] for i in idx) / len(idx):.3f} | "
                         f"{sum(g_ok[j] for j in g_idx) / len(g_idx):.3f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

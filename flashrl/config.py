"""config.toml as typed msgspec structs, and the one ``load()`` that reads it.

Every field has a type, a default, a bound where one applies and a one-line description
(``Meta(description=...)``). ``load()`` turns every problem (missing file, invalid TOML, unknown key,
wrong type, out-of-range value, inconsistent values) into one ``ConfigError`` whose message names the
key path and what is expected; the CLI prints it and exits with code 2 before any process starts.

Over 600 lines because it is the whole configuration reference: one struct per section, each field with its description.
"""

from __future__ import annotations

import importlib.util
import math
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from flashrl.config_errors import describe
from flashrl.distill.config import DistillConfig
from flashrl.distill.config import check as distill_check
from flashrl.moe.config import MoeConfig
from flashrl.vision.config import VisionConfig


class ConfigError(ValueError):
    """A config problem; the message names the key path (or TOML line) and the fix."""


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class RunConfig(Section):
    name: Annotated[str, Meta(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="run name; output goes to <output_dir>/<name>/")] = "tiny"
    output_dir: Annotated[str, Meta(description="parent folder of run directories")] = "runs"
    seed: Annotated[int, Meta(ge=0, description="seed for data order, sampling and init")] = 0
    steps: Annotated[int, Meta(ge=1, description="training steps (weight updates) to run")] = 60
    max_time_s: Annotated[float, Meta(ge=0, description="stop after this many seconds of training (0 = no limit)")] = 0.0
    eval_every: Annotated[int, Meta(ge=0, description="evaluate on the held-out split every N steps (0 = only at start and end)")] = 10
    eval_engines: Annotated[int, Meta(ge=0, description=(
        "engines an eval runs on (0 = all): with fewer than engine.count, the others keep loading each new "
        "version while an eval holds its engines at the evaluated one, so the trainer never waits for an "
        "eval's stragglers (multi-turn evals); with all, it waits once an eval outlasts async_ratio + 1 steps"))] = 0
    dashboard: Annotated[Literal["auto", "rich", "plain", "off"], Meta(description="auto: rich live view on a terminal, plain lines otherwise")] = "auto"
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], Meta(description="log level of every process")] = "INFO"
    checkpoint_every: Annotated[int, Meta(ge=0, description="checkpoint every N steps into <run dir>/checkpoints/step-<N>/ (0 = only at the end, on Ctrl-C/SIGTERM and at max_time_s); resume with `flashrl run CONFIG --resume`")] = 50
    auto_resume: Annotated[int, Meta(ge=0, le=100, description="after a failure (e.g. a trainer rank died), restart every process from the latest checkpoint, up to N times (0 = stop)")] = 0
    keep_checkpoints: Annotated[int, Meta(ge=1, description="checkpoints kept (the oldest are deleted once a newer one is complete)")] = 3


class ModelBuildConfig(Section):
    """``[model.build]``: how flashrl builds the folder ``model.path`` names when it is missing (``flashrl
    init-model``, or ``flashrl run``); ``recipe = "none"``: the folder is yours to provide."""

    recipe: Annotated[Literal["none", "chat"], Meta(description=(
        'none: model.path is a model you provide (downloaded, or your own); chat: a random-weight chat model '
        'built locally, a byte-level BPE trained on the fly and a chat template (flashrl/models/chat_model.py)'))] = "none"
    size: Annotated[Literal["tiny", "0.25b"], Meta(description=(
        "chat: tiny (2 layers, a 512-token BPE; seconds) or 0.25b (a 0.27B-parameter Qwen3, a 32k BPE; "
        "minutes)"))] = "tiny"
    arch: Annotated[Literal["qwen3", "llama"], Meta(description="chat: the architecture")] = "qwen3"
    template: Annotated[Literal["chatml", "qwen3"], Meta(description=(
        "chat: chatml (plain turns) or qwen3 (<think> reasoning, dropped from earlier assistant turns)"))] = "chatml"
    seed: Annotated[int, Meta(ge=0, description="chat: seed of the weights and the tokenizer's corpus")] = 0


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """``[model.lora]``: train low-rank adapters on the model's projections instead of every weight (peft's
    LoRA: W x + (alpha / rank) B A x); rank 0 (the default) is full fine-tuning."""

    rank: Annotated[int, Meta(ge=0, le=512, description=(
        "adapter rank r (0 = off: full fine-tuning); at most the smaller side of every target projection, "
        "and 512 (the largest rank vLLM serves)"))] = 0
    alpha: Annotated[int, Meta(ge=1, description="scaling numerator: the adapter's output is scaled by alpha / rank")] = 32
    dropout: Annotated[float, Meta(ge=0.0, lt=1.0, description="dropout on the adapter's input while training")] = 0.0
    target_modules: Annotated[list[LoraTarget], Meta(min_length=1, description=(
        "projections that get an adapter (Llama / Qwen2 / Qwen3 names)"))] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class ModelConfig(Section):
    path: Annotated[str, Meta(min_length=1, description='"builtin:tiny" or "builtin:moe" (a Mixture-of-Experts) or "builtin:vlm" (a vision-language model; all built and warm-started by flashrl) or a local Hugging Face model folder')] = "builtin:tiny"
    cache_dir: Annotated[str, Meta(description="where the built-in model is cached (built once)")] = ".cache/flashrl"
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], Meta(description="weights dtype for engines and trainer")] = "float32"
    max_model_len: Annotated[int, Meta(ge=16, le=1 << 20, description="prompt + response tokens per sequence")] = 128
    chat_template: Annotated[Literal["auto", "on", "off"], Meta(description="auto: prompts and multi-turn observations rendered with the model folder's chat template when it has one; on: require one; off: raw prompt text")] = "auto"
    system_prompt: Annotated[str, Meta(description="system message of every chat prompt (needs a chat template; empty = none)")] = ""
    build: ModelBuildConfig = msgspec.field(default_factory=ModelBuildConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


class EnvConfig(Section):
    name: Annotated[str, Meta(min_length=1, description="a built-in environment (arithmetic, scratchpad, countdown, guess, tools, code, dataset, remote), a plug-in of the entry-point group flashrl.envs, or your own class: 'package.module:Class' or './file.py:Class'")] = "arithmetic"
    params: Annotated[dict[str, Any], Meta(description="environment-specific options, checked by the environment's own struct")] = {}
    eval_size: Annotated[int, Meta(ge=1, description="held-out tasks per evaluation")] = 200


class RolloutConfig(Section):
    """``[rollout]``. The default geometry, 32 prompts x 4 samples per step, is the measured best of the
    embedded default at 128 samples per step: 80% held-out at step 34 on average over 8 seeds against 58
    for 8 x 16, at the same samples/s (bench/results/geometry). A task whose successes are rarer wants
    larger groups (a group whose samples all agree has no advantage)."""

    group_size: Annotated[int, Meta(ge=1, le=4096, description="samples per prompt (GRPO group)")] = 4
    batch_prompts: Annotated[int, Meta(ge=1, description="prompts (groups) per training batch")] = 32
    max_new_tokens: Annotated[int, Meta(ge=1, description="tokens generated per turn")] = 8
    temperature: Annotated[float, Meta(ge=0, le=2, description="sampling temperature for training rollouts; the trainer scores logprobs at the same temperature (logits / T)")] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1, description="nucleus sampling for training rollouts; below 1 the engines' logprobs are renormalized over the nucleus, the trainer's are not (importance weights carry the nucleus mass)")] = 1.0
    eval_temperature: Annotated[float, Meta(ge=0, le=2, description="sampling temperature for held-out evaluation (0 = greedy)")] = 0.0
    redundancy: Annotated[int, Meta(ge=0, description="extra rollouts per group; rollout.redundant_keep says which group_size are kept")] = 0
    redundant_keep: Annotated[Literal["finish_order", "launch_order"], Meta(description=(
        "with redundancy: finish_order keeps the first group_size rollouts to finish (fastest; biases the trained "
        "sample toward short, early-finishing trajectories); launch_order keeps the first group_size in launch "
        "order that succeed, so the extra rollouts only stand in for failed or timed-out ones (unbiased)"))] = "finish_order"
    max_turns: Annotated[int, Meta(ge=1, description="environment turns per trajectory (1 = single-turn RLVR)")] = 1
    turn_timeout_s: Annotated[float, Meta(gt=0, description="deadline for one environment step")] = 60.0
    trajectory_timeout_s: Annotated[float, Meta(gt=0, description="deadline for one whole trajectory")] = 600.0
    max_retries: Annotated[int, Meta(ge=0, description="retries of a rollout after an infrastructure failure")] = 2
    env_async: Annotated[bool, Meta(description="environment-level async: engines serve others while an env steps")] = True


class SchedulerConfig(Section):
    """``[scheduler]``. ``stale`` defaults to ``partial``, measured in the simulator (docs/algorithms.md,
    staleness): the fastest of the three by samples/s and trained tokens/s (2.70x sync at 8x8 and async
    ratio 1, against 2.38x for drop and 1.69x for wait), nothing thrown away, and trained tokens per step
    within ~1% of sync's (drop: 11% fewer, the length bias); ``wait`` is the strict first-token bound."""

    async_ratio: Annotated[int, Meta(ge=0, le=64, description="max policy versions a trained sample may lag: from its first token (stale = drop, wait) or from its completion (partial); 0 = synchronous")] = 2
    queue_scheduling: Annotated[bool, Meta(description="refill engine slots as samples finish (off = batch barrier)")] = True
    replication: Annotated[bool, Meta(description="spread a prompt's samples over engines (off = one engine per prompt)")] = True
    stale: Annotated[Literal["drop", "wait", "partial"], Meta(description=(
        "what happens to a sample too old for the bound (flashrl/core/staleness.py states each mode's guarantee): "
        "drop = dropped and its prompt redrawn (trained data biased toward short answers; for comparison); "
        "wait = nothing dropped, a step is held until the groups it leaves behind can still be trained within "
        "async_ratio versions of their first token (strict bound); partial = nothing dropped or held, generation "
        "goes on under new weights, each token keeps its own version and behaviour logprob and the loss corrects "
        "it per token (bound: a group is trained within async_ratio versions of completing)"))] = "partial"
    admit_during_evals: Annotated[bool, Meta(description=(
        "partial mode (async_ratio >= 1, queue_scheduling): while an eval holds the engines' weights, admit "
        "groups into the slots of the batches whose updates it defers (counted admitted/lent_slots); they "
        "generate beside the eval and may train the async_ratio + 1 steps after those the held version's own "
        "samples allow, so the trainer need not wait for the eval's end; their first tokens may then lag up "
        "to 2 * async_ratio + 1 versions. For environment-bound episodes (multi-turn, slow tools: configs/agentic.toml "
        "and tools.toml set it); on one engine with short single-turn answers the borrowers' generation slows "
        "the eval itself and the trainer waits longer (off: the trainer stops at async_ratio steps past the held "
        "version until the eval ends)"))] = False
    drain: Annotated[bool, Meta(description=(
        "admit no more groups than the run's remaining steps train, so its last steps drain what was admitted "
        "and it ends with nothing generating: no rollout thrown away, the same prompts trained as the "
        "synchronous loop, no length bias from the long answers a fixed step count leaves in flight; false: "
        "keep every slot full to the last step (faster last steps; what is still generating at the end is "
        "lost, or kept in the final checkpoint in partial mode for a --resume with more steps)"))] = True


    @property
    def lends_slots(self) -> bool:
        """Whether admit_during_evals applies: partial mode, async, queue scheduling (controller/buffer.py, 6)."""
        return self.admit_during_evals and self.stale == "partial" and self.async_ratio > 0 and self.queue_scheduling


class EngineConfig(Section):
    """``[engine]``. One engine by default: on a small CPU machine a second engine process only adds its
    fixed cost per step (bench/results/steptime); on GPUs set one engine per GPU not used by the trainer.
    ``max_num_seqs`` depends on the model and the hardware: the embedded default's tiny model steps faster
    with 256 (configs/tiny.toml), the simulator's H100 profile assumes 128."""

    count: Annotated[int, Meta(ge=1, le=1024, description="inference engine processes")] = 1
    device: Annotated[Literal["auto", "cpu", "cuda"], Meta(description="auto: cuda when a GPU is visible, else cpu")] = "auto"
    kv_cache_gib: Annotated[float, Meta(gt=0, description="CPU KV cache per engine in GiB (VLLM_CPU_KVCACHE_SPACE)")] = 0.5
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1, description="fraction of GPU memory per engine (cuda)")] = 0.5
    max_num_seqs: Annotated[int, Meta(ge=1, description="concurrent sequences per engine")] = 128
    threads: Annotated[int, Meta(ge=1, description="CPU threads per engine (cpu)")] = 1
    nice: Annotated[int, Meta(ge=0, le=19, description="CPU priority of the engine processes (Linux nice, 0 = "
                              "normal, up to 19): where engines share the cores with the trainer (a laptop), a "
                              "higher value leaves the trainer's step, the critical path, the cores it needs")] = 0
    startup_timeout_s: Annotated[float, Meta(ge=0, description="seconds to wait for an engine (and the trainer ranks) to come up; 0 = auto: 600 s + the model's float32 bytes / 25 MB/s (flashrl/deadlines.py)")] = 0.0
    heartbeat_s: Annotated[float, Meta(ge=0, description="heartbeat interval (0 = off)")] = 5.0
    max_restarts: Annotated[int, Meta(ge=0, description="restarts of one engine within restart_window_s after it dies; past that it stays down and the run goes on with the others (0 = never restart)")] = 3
    restart_window_s: Annotated[float, Meta(gt=0, description="window over which engine.max_restarts counts an engine's restarts")] = 600.0
    top_logprobs: Annotated[int, Meta(ge=0, le=20, description="the k most likely tokens' logprobs the engines return "
                                      "for each generated token (vLLM logprobs=k, up to its max_logprobs 20), kept "
                                      "in each trajectory's top_logprobs and padded into the trainer's batch "
                                      "(top_ids, top_logp); 0 = off")] = 0


class TrainerConfig(Section):
    """``[trainer]``. The lr schedule defaults to what the embedded default measured best: a 20-step warm-up,
    then a cosine decay to a tenth of the lr at run.steps (with a constant lr a run ended wherever its
    plateau's noise left it: seeds 0-2 at 83.0, 78.0, 88.8% against 86.8, 85.8, 93.5% decayed;
    bench/results/lr-decay). One mini-batch per step: configs/tiny.toml's 2 mirror TRL's set-up in the
    peers bench; 1 and 2 measured alike (bench/results/geometry, 4 x 16)."""

    ranks: Annotated[int, Meta(ge=1, le=4096, description="trainer processes (FSDP2 ranks)")] = 1
    backend: Annotated[Literal["auto", "gloo", "nccl"], Meta(description="torch.distributed backend (auto: nccl on GPU, gloo on CPU)")] = "auto"
    lr: Annotated[float, Meta(gt=0, le=1, description="AdamW learning rate")] = 1e-4
    weight_decay: Annotated[float, Meta(ge=0, description="AdamW weight decay")] = 0.0
    grad_clip: Annotated[float, Meta(ge=0, description="max gradient norm (0 = off)")] = 1.0
    micro_batch: Annotated[int, Meta(ge=1, description="samples per forward/backward on one rank")] = 64
    mini_batches: Annotated[int, Meta(ge=1, le=1024, description="optimizer steps per training batch (the batch split into this many mini-batches)")] = 1
    warmup_steps: Annotated[int, Meta(ge=0, description="linear lr warm-up over this many training steps: step s (from 0) uses lr * min(1, (s + 1) / warmup_steps); 0 = off")] = 20
    lr_decay: Annotated[Literal["none", "linear", "cosine"], Meta(
        description="after the warm-up, decay the lr to lr * min_lr_ratio at the last step (run.steps); "
                    "none: constant")] = "cosine"
    min_lr_ratio: Annotated[float, Meta(ge=0, le=1, description="the decay's end as a fraction of lr")] = 0.1
    threads: Annotated[int, Meta(ge=1, description="torch CPU threads per rank")] = 1
    cpu_mixed_precision: Annotated[bool, Meta(description="on CPU, forward and backward in model.dtype as on GPU (FSDP2 MixedPrecisionPolicy, float32 master weights and gradient reduction): engine and trainer compute in the same dtype; false: float32 on CPU whatever model.dtype")] = False
    shuffle: Annotated[bool, Meta(description="deal the batch's samples into its mini-batches in a seeded random "
                                  "order (run.seed, step), as TRL's GRPOTrainer does; false: contiguous slices "
                                  "(a group's samples stay in one mini-batch)")] = False
    share_prefix: Annotated[bool, Meta(description="forward each distinct prompt of a micro-batch once and every "
                                       "sample's continuation against its keys/values (a group's samples share "
                                       "their prompt); false: every sample forwards its whole sequence")] = True
    skip_inert: Annotated[bool, Meta(description="leave out of the step's forwards and backwards the samples whose loss "
                                     "and gradient are exactly zero (every advantage 0: a group whose rewards all "
                                     "tie) where the loss has no term without the advantage (losses ppo, grpo, "
                                     "decoupled_ppo, tis, cispo, gspo; no entropy bonus, no KL, no critics): the "
                                     "same update with less compute; the loss and mismatch/* metrics then cover "
                                     "the samples trained")] = True
    checkpoint_async: Annotated[bool, Meta(description="write checkpoints in the background: the training state is "
                                           "copied to host staging buffers (one more host copy of weights and AdamW "
                                           "state, kept for the run) and DCP writes it while training goes on; the "
                                           "checkpoint appears only once written on every rank (docs/checkpoints.md); "
                                           "false: training waits for each write")] = True
    checkpoint_writer: Annotated[Literal["auto", "process", "thread"], Meta(description="who writes a background "
                                 "checkpoint (checkpoint_async): 'process', a writer process per rank (DCP's "
                                 "process-based async save; staged into shared memory, at the lowest CPU priority), "
                                 "so the write never takes the trainer's interpreter lock; 'thread', a thread of "
                                 "the trainer; 'auto': process for a model of >= 256 MiB of float32 weights "
                                 "(CPU or GPU), else thread (docs/checkpoints.md)")] = "auto"
    checkpoint_timeout_s: Annotated[float, Meta(ge=0, description="deadline for one checkpoint write (and for the "
                                                "wait for it at shutdown); 0 = auto: 300 s + 3 x the model's float32 "
                                                "bytes / 25 MB/s (flashrl/deadlines.py)")] = 0.0


class DecoupledPPOOptions(Section):
    """``[algorithm.decoupled_ppo]``: options of loss = "decoupled_ppo"."""

    w_max: Annotated[float, Meta(gt=0, description="cap on the behaviour importance weight")] = 5.0


class TISOptions(Section):
    """``[algorithm.tis]``: options of loss = "tis"."""

    cap: Annotated[float, Meta(gt=0, description="truncation C of the importance ratio")] = 2.0


class CISPOOptions(Section):
    """``[algorithm.cispo]``: options of loss = "cispo"."""

    eps_low: Annotated[float, Meta(ge=0, description="lower clip of the IS weight (1 = none)")] = 1.0
    eps_high: Annotated[float, Meta(ge=0, description="upper clip of the IS weight")] = 0.2


class GSPOOptions(Section):
    """``[algorithm.gspo]``: options of loss = "gspo"."""

    eps_low: Annotated[float, Meta(ge=0, description="sequence-ratio clip below 1")] = 3e-4
    eps_high: Annotated[float, Meta(ge=0, description="sequence-ratio clip above 1")] = 4e-4


class AsyPPOOptions(Section):
    """``[algorithm.asyppo]``: the mini-critics of loss = "asyppo" (arXiv 2510.01656). Critic size/lr are
    ours (not published for tiny models)."""

    num_critics: Annotated[int, Meta(ge=2, le=16, description="number of mini-critics M (paper: 2)")] = 2
    k_adv: Annotated[float, Meta(ge=0, le=1, description="fraction of valid tokens with the lowest critic std whose advantage is masked (paper: 0.2)")] = 0.2
    k_ent: Annotated[float, Meta(ge=0, le=1, description="fraction of valid tokens with the highest critic std left out of the entropy bonus (paper: 0.2)")] = 0.2
    lr: Annotated[float, Meta(gt=0, le=1, description="AdamW learning rate of the critics")] = 1e-3
    layers: Annotated[int, Meta(ge=1, le=64, description="transformer layers per mini-critic")] = 1
    hidden: Annotated[int, Meta(ge=8, le=8192, description="hidden size per mini-critic (multiple of 4 heads)")] = 64
    updates: Annotated[int, Meta(ge=1, le=64, description="critic regression steps per training step")] = 1
    gamma: Annotated[float, Meta(ge=0, le=1, description="GAE discount")] = 1.0
    gae_lambda: Annotated[float, Meta(ge=0, le=1, description="GAE lambda")] = 0.95


class RhythmOptions(Section):
    """``[algorithm.rhythm]``: attention-rhythm credit (credit != "none"; arXiv 2510.13554)."""

    top_frac: Annotated[float, Meta(ge=0, le=1, description="fraction of response tokens amplified (paper: 0.4)")] = 0.4
    amplify: Annotated[float, Meta(ge=1, le=10, description="advantage scale of selected tokens (paper: 1.5)")] = 1.5
    window: Annotated[int, Meta(ge=1, le=4096, description="WAAD distance clip W (paper: 10)")] = 10
    coupling: Annotated[float, Meta(ge=0, le=1, description="share a of the bonus moved from a dominated anchor to its introducing WAAD peak (not published)")] = 0.5
    tau_waad: Annotated[float, Meta(ge=0, description="WAAD at or below this marks an anchor as locally dominated (not published)")] = 2.0
    tau_delta: Annotated[float, Meta(ge=0, description="a WAAD jump at least this large in the previous 3 tokens marks an introducing peak (not published)")] = 1.0
    positive_only: Annotated[bool, Meta(description="amplify only tokens with advantage >= 0")] = False


class AlgorithmConfig(Section):
    """``[algorithm]``: the loss and what every loss shares; each loss's own options in its table
    (``[algorithm.cispo]`` ...), which may only be set for the chosen loss (``load`` refuses the others, naming the table).

    The default loss is ``decoupled_ppo``: asynchronous samples are up to async_ratio versions old, and
    plain ``ppo`` treats them as on-policy (at async ratio 8 it collapsed to 46% held-out where
    decoupled_ppo held 77%; bench/results/algorithms)."""

    loss: Annotated[Literal["ppo", "grpo", "decoupled_ppo", "tis", "topr", "cispo", "gspo", "asyppo"], Meta(description="policy loss (formulas: docs/algorithms.md)")] = "decoupled_ppo"
    scale_std: Annotated[bool, Meta(description="GRPO: divide by the group std (false = Dr. GRPO)")] = True
    filter_ties: Annotated[bool, Meta(description="drop groups whose rewards all tie (DAPO dynamic sampling)")] = False
    loss_agg: Annotated[Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"], Meta(description="loss aggregation")] = "token-mean"
    eps_low: Annotated[float, Meta(ge=0, le=1, description="PPO clip below 1 (ppo, grpo, decoupled_ppo, asyppo)")] = 0.2
    eps_high: Annotated[float, Meta(ge=0, description="PPO clip above 1 (ppo, grpo, decoupled_ppo, asyppo)")] = 0.2
    dual_clip: Annotated[float, Meta(ge=0, description="dual-clip constant c for A < 0 (0 = off; paper value 3)")] = 0.0
    entropy_coef: Annotated[float, Meta(ge=0, description="entropy bonus beta")] = 0.0
    kl_coef: Annotated[float, Meta(ge=0, description="k3 KL to the initial (reference) policy")] = 0.0
    credit: Annotated[Literal["none", "waad", "fai", "rhythm"], Meta(description="attention-rhythm credit assignment")] = "none"
    decoupled_ppo: DecoupledPPOOptions = msgspec.field(default_factory=DecoupledPPOOptions)
    tis: TISOptions = msgspec.field(default_factory=TISOptions)
    cispo: CISPOOptions = msgspec.field(default_factory=CISPOOptions)
    gspo: GSPOOptions = msgspec.field(default_factory=GSPOOptions)
    asyppo: AsyPPOOptions = msgspec.field(default_factory=AsyPPOOptions)
    rhythm: RhythmOptions = msgspec.field(default_factory=RhythmOptions)


# Per-loss option groups: the loss (or credit mode) each table belongs to.
LOSS_OPTIONS = ("decoupled_ppo", "tis", "cispo", "gspo", "asyppo")
# Keys that lived flat in [algorithm] before the per-loss groups -> where they are now.
MOVED_ALGORITHM_KEYS = {
    "w_max": "decoupled_ppo.w_max", "tis_cap": "tis.cap",
    "cispo_eps_low": "cispo.eps_low", "cispo_eps_high": "cispo.eps_high",
    "gspo_eps_low": "gspo.eps_low", "gspo_eps_high": "gspo.eps_high",
    "num_critics": "asyppo.num_critics", "critic_k_adv": "asyppo.k_adv", "critic_k_ent": "asyppo.k_ent",
    "critic_lr": "asyppo.lr", "critic_layers": "asyppo.layers", "critic_hidden": "asyppo.hidden",
    "critic_updates": "asyppo.updates", "gamma": "asyppo.gamma", "gae_lambda": "asyppo.gae_lambda",
    "rhythm_top_frac": "rhythm.top_frac", "rhythm_amplify": "rhythm.amplify", "rhythm_window": "rhythm.window",
    "rhythm_coupling": "rhythm.coupling", "tau_waad": "rhythm.tau_waad", "tau_delta": "rhythm.tau_delta",
    "rhythm_positive_only": "rhythm.positive_only",
}


class RewardModelConfig(Section):
    """[reward]: a scalar reward model (a Hugging Face sequence-classification folder) scoring every finished
    episode beside the environment's verifier, in worker processes of its own (docs/rewards.md)."""

    model: Annotated[str, Meta(description=(
        'the reward model: "" = none (the environment\'s verifier alone), "builtin:rm" (built by `flashrl '
        'init-model` from the environment\'s verifier, Bradley-Terry on preference pairs, cached) or a local '
        "Hugging Face folder whose config.json names a *ForSequenceClassification architecture with one label"))] = ""
    combine: Annotated[Literal["sum", "gate"], Meta(description=(
        'how the model reward and the verifier\'s reward make the training reward: "sum" = model_weight x model '
        '+ verifier_weight x verifier; "gate" = max(gate_reward, 0) + model_weight x u(model), u in [0, 1], where the '
        "verifier passes (reward >= gate_threshold), gate_reward where it does not: a pass ranks above a fail"))] = "sum"
    model_weight: Annotated[float, Meta(ge=-1e6, le=1e6, description="weight of the model reward")] = 1.0
    verifier_weight: Annotated[float, Meta(ge=-1e6, le=1e6, description=(
        "weight of the verifier's reward in the sum (0 = the verifier is held-out truth only: logged, never trained on)"))] = 0.0
    gate_threshold: Annotated[float, Meta(ge=-1e6, le=1e6, description="gate: the verifier reward at or above which the model reward counts")] = 1.0
    gate_reward: Annotated[float, Meta(ge=-1e6, le=1e6, description="gate: the reward of an episode the verifier fails")] = 0.0
    transform: Annotated[Literal["sigmoid", "raw"], Meta(description=(
        'the model reward from the model\'s score: "sigmoid" = sigmoid(score) in (0, 1); "raw" = the score'))] = "sigmoid"
    normalize: Annotated[bool, Meta(description=(
        "normalize the model reward by the running mean and std of the model rewards of the training episodes scored "
        "before it (Welford, from the run's start, kept in checkpoints) before combining"))] = False
    score_evals: Annotated[bool, Meta(description=(
        "score held-out (eval) episodes with the reward model or judge too: eval/reward/<rm|judge>_* then show the "
        "model against the verifier on held-out; false = held-out episodes get the verifier's reward alone and take "
        "no model time (an async run's evals share the judge or reward model with training; eval accuracy is the "
        "verifier's either way)"))] = True
    workers: Annotated[int, Meta(ge=1, le=64, description="reward-model worker processes (one batch at a time each)")] = 1
    runner: Annotated[Literal["auto", "torch", "vllm"], Meta(description=(
        'what serves the reward model in each worker: "vllm" = vLLM\'s pooling runner (classify, raw logit; '
        '*ForSequenceClassification of the causal LMs vLLM knows), "torch" = transformers, "auto" = vllm, torch where '
        "vLLM cannot load the folder on this device (logged, counted as env/rm_workers_torch)"))] = "auto"
    kv_cache_gib: Annotated[float, Meta(gt=0, le=1024, description="KV cache per worker in GiB (runner vllm on cpu)")] = 0.25
    threads: Annotated[int, Meta(ge=1, le=256, description="torch CPU threads per reward-model worker")] = 1
    device: Annotated[Literal["cpu", "cuda"], Meta(description="where the reward-model workers run the model")] = "cpu"
    max_batch: Annotated[int, Meta(ge=1, le=65536, description="episodes scored in one forward")] = 64
    cache_size: Annotated[int, Meta(ge=0, le=100_000_000, description=(
        "scores kept for reuse (least recently used out first; ~150 bytes each): the same text scored again, or while "
        "it is still being scored, gets the score it got, without a forward (env/rm_cached); 0 = every episode is scored"))] = 100_000
    batch_wait_ms: Annotated[float, Meta(ge=0, le=60_000, description=(
        "how long a batch waits for more episodes before it is sent (a full batch goes at once)"))] = 5.0
    timeout_s: Annotated[float, Meta(gt=0, le=86_400, description=(
        "deadline of one batch on a worker; past it the worker is killed (counted), restarted and the batch retried"))] = 30.0
    retries: Annotated[int, Meta(ge=0, le=100, description=(
        "retries of a batch after a worker died, hung or sent garbage (counted apart: env/rm_retries); past them "
        "each episode fails as an infrastructure failure (the rollout is retried, never scored 0)"))] = 3
    startup_timeout_s: Annotated[float, Meta(gt=0, le=86_400, description="deadline for a worker to load the model and answer")] = 120.0


class JudgeConfig(Section):
    """[judge]: a generative judge, a causal LM served by vLLM engine processes of its own, that reads the prompt
    and the policy's answer and gives a verdict (pass/fail, or a score); its weights never change (docs/rewards.md).
    The verdict (1 = pass, 0 = fail; a score mapped to [0, 1]) is the model reward [reward]'s combine keys
    combine with the verifier's."""

    model: Annotated[str, Meta(description=(
        'the judge: "" = none, "builtin:judge" (a built-in model warm-started on verdicts the environment\'s '
        "verifier gave, built by `flashrl init-model`, cached) or a local Hugging Face causal-LM folder"))] = ""
    engines: Annotated[int, Meta(ge=1, le=64, description=(
        "judge engine processes (vLLM), placed by cluster.launcher like the policy's engines: local (this machine; on "
        "cuda each gets a GPU of its own after the trainer ranks' and the engines' when there are enough), ray "
        "(a placement group of cluster.ray.judge_* bundles), slurm (cluster.slurm.layout's judges, or the automatic layout)"))] = 1
    template: Annotated[str, Meta(min_length=1, description=(
        "the judge's prompt; {prompt} = the policy's prompt, {response} = its answer (to its EOS, stripped, without the fence tags <response> </response>)"))] = "{prompt}<response>{response}</response>?"
    pass_pattern: Annotated[str, Meta(min_length=1, description="a regular expression: a verdict it matches is pass (default: its last word is 1, pass or yes, as builtin:judge writes it after its own solution)")] = "(^|\\s)(1|P|pass|PASS|yes)\\s*$"
    fail_pattern: Annotated[str, Meta(min_length=1, description="a regular expression: a verdict it matches is fail (default: its last word is 0, fail or no)")] = "(^|\\s)(0|F|fail|FAIL|no)\\s*$"
    verdict: Annotated[Literal["pass_fail", "score"], Meta(description=(
        'how the judge\'s answer is read: "pass_fail" = pass_pattern / fail_pattern (1 or 0); "score" = a number '
        "score_pattern finds, mapped from [score_min, score_max] to [0, 1] (a number outside the range, or none, is "
        "unparsable)"))] = "pass_fail"
    score_pattern: Annotated[str, Meta(min_length=1, description=(
        'verdict = "score": a regular expression with one group, the score; its last match in the answer counts '
        '(default: a number ending the answer; e.g. "Rating: (\\d+)" for "Rating: 7/10")'))] = "(-?\\d+(?:\\.\\d+)?)\\s*$"
    score_min: Annotated[float, Meta(description='verdict = "score": the lowest score the judge is asked to give (reward 0)')] = 0.0
    score_max: Annotated[float, Meta(description='verdict = "score": the highest score (reward 1)')] = 10.0
    max_new_tokens: Annotated[int, Meta(ge=1, le=4096, description="tokens the judge may write per verdict (builtin:judge: its solution, a space, the answer copied, a space, the verdict)")] = 12
    temperature: Annotated[float, Meta(ge=0, le=2, description="the judge's sampling temperature (0 = greedy)")] = 0.0
    cache_size: Annotated[int, Meta(ge=0, le=100_000_000, description=(
        "verdicts kept for reuse (least recently used out first; ~150 bytes each): a greedy judge (temperature 0) asked "
        "the same text again, or while it is still answering it, gives the verdict it gave, without engine time "
        "(env/judge_cached); only verdicts that parsed at the first try are kept; 0 = every episode asks the engine"))] = 100_000
    on_unparsable: Annotated[Literal["retry", "default"], Meta(description=(
        'a verdict neither pattern matches: "retry" asks again (sampled at temperature 1, up to parse_retries times, '
        'then the default); "default" takes unparsable_reward at once. Counted as env/judge_unparsable either way'))] = "retry"
    parse_retries: Annotated[int, Meta(ge=0, le=100, description="retries of an unparsable verdict (on_unparsable = \"retry\")")] = 2
    unparsable_reward: Annotated[float, Meta(ge=0, le=1, description="the verdict an unparsable answer gets in the end (0 = fail)")] = 0.0
    timeout_s: Annotated[float, Meta(gt=0, le=86_400, description="deadline of one verdict on an engine; past it the request is retried")] = 60.0
    retries: Annotated[int, Meta(ge=0, le=100, description=(
        "retries of a verdict after its engine died or hung (counted apart: env/judge_retries); past them the episode "
        "fails as an infrastructure failure (the rollout is retried, never scored 0)"))] = 3
    max_restarts: Annotated[int, Meta(ge=0, le=1000, description="restarts of judge engines in the run, after a death or a failed start; with every engine down and these spent the run stops (JudgeDown)")] = 5
    kv_cache_gib: Annotated[float, Meta(gt=0, description="CPU KV cache per judge engine in GiB")] = 0.25
    max_num_seqs: Annotated[int, Meta(ge=1, description="concurrent verdicts per judge engine")] = 256
    threads: Annotated[int, Meta(ge=1, description="CPU threads per judge engine (cpu)")] = 1
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1, description="fraction of GPU memory per judge engine (cuda; the judge runs on engine.device)")] = 0.5
    startup_timeout_s: Annotated[float, Meta(gt=0, le=86_400, description="deadline for a judge engine to come up")] = 600.0


class WeightSyncConfig(Section):
    bucket_mb: Annotated[float, Meta(gt=0, description="MiB per broadcast bucket")] = 64.0
    timeout_s: Annotated[float, Meta(ge=0, description="deadline for one weight sync; 0 = auto: 300 s + the model's float32 bytes / 25 MB/s (flashrl/deadlines.py)")] = 0.0
    overlap: Annotated[bool, Meta(description="broadcast version v+1 and load it on the engines while the trainer trains the next step (only the prepare, the gather + pack, stays on the step's path); false = the serial order: train, sync, next step")] = True
    load: Annotated[Literal["whole", "bucket"], Meta(description='how an engine loads a sync: "whole" = receive and verify every bucket beside generation, then load (generation stops for the load only; the engine holds one more copy of the weights meanwhile); "bucket" = after a checked manifest, receive, verify and load one bucket at a time (the extra copy is a few buckets; generation stops for the whole transfer; a bucket corrupt mid-way leaves a partly-loaded model: that engine exits and is restarted, never serving it)')] = "whole"


class LogConfig(Section):
    samples_per_step: Annotated[int, Meta(ge=0, le=4096, description="training rollouts per step written to runs/<name>/samples.jsonl (0 = none)")] = 4
    eval_samples: Annotated[int, Meta(ge=0, description="held-out generations per evaluation written to samples.jsonl (0 = none)")] = 8
    tensorboard: Annotated[bool, Meta(description="also write metrics as TensorBoard event files to runs/<name>/tensorboard/ (extra: flashrl[log])")] = False
    wandb: Annotated[bool, Meta(description="also log metrics to Weights & Biases (extra: flashrl[log]); files under runs/<name>/wandb/")] = False
    wandb_project: Annotated[str, Meta(min_length=1, description="W&B project")] = "flashrl"
    wandb_mode: Annotated[Literal["offline", "online"], Meta(description="offline: no network, sync later with `wandb sync`")] = "offline"


class SlurmNodeConfig(Section):
    engines: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(description="engine indices this node runs (one GPU each when gpus_per_node > 0)")] = []
    trainer_ranks: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(description="trainer ranks this node runs (one GPU each when gpus_per_node > 0)")] = []
    judges: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(description="judge engine indices this node runs (judge.engines; one GPU each when gpus_per_node > 0)")] = []


class SlurmConfig(Section):
    nodes: Annotated[int, Meta(ge=1, le=4096, description="nodes of the allocation (#SBATCH --nodes); node 0, the first, runs the controller and is the rendezvous")] = 1
    gpus_per_node: Annotated[int, Meta(ge=0, le=64, description="GPUs per node (#SBATCH --gpus-per-node); every engine and trainer rank takes one; 0 = CPU nodes")] = 0
    cpus_per_node: Annotated[int, Meta(ge=0, le=4096, description="CPUs per node for flashrl's one task per node (#SBATCH --cpus-per-task); 0 = whole nodes (#SBATCH --exclusive --mem=0)")] = 0
    partition: Annotated[str, Meta(description="#SBATCH --partition (empty = the cluster's default)")] = ""
    account: Annotated[str, Meta(description="#SBATCH --account (empty = your default)")] = ""
    time: Annotated[str, Meta(pattern=r"^$|^(\d+-)?\d+(:\d+){0,2}$", description='#SBATCH --time, e.g. "04:00:00" or "1-00:00:00" (empty = the partition\'s default)')] = "01:00:00"
    job_name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]*$", description="#SBATCH --job-name (empty = flashrl-<run.name>)")] = ""
    sbatch: Annotated[list[Annotated[str, Meta(pattern=r"^--?[A-Za-z]")]], Meta(description='extra #SBATCH lines, e.g. ["--qos=high", "--exclusive"]')] = []
    setup: Annotated[list[str], Meta(description='shell lines run on every node before flashrl, e.g. ["module load cuda/12.4"]')] = []
    python: Annotated[str, Meta(description="the flashrl python on the nodes (empty = the one rendering the script)")] = ""
    port: Annotated[int, Meta(ge=1024, le=65000, description="the node agent of node N listens on port + N (TCP, CURVE)")] = 29400
    layout: Annotated[list[SlurmNodeConfig], Meta(description="which node runs what: one [[cluster.slurm.layout]] table per node (empty = auto: trainer ranks from node 0 on, then engines, then judge engines)")] = []
    heartbeat_timeout_s: Annotated[float, Meta(gt=0, description="a node agent that hears nothing from node 0 this long stops its processes and exits")] = 30.0
    connect_timeout_s: Annotated[float, Meta(gt=0, description="how long node 0 waits for every node agent to answer at start")] = 600.0


class RayConfig(Section):
    """[cluster.ray]: where the Ray launcher (cluster.launcher = "ray") places engines and trainer ranks."""

    address: Annotated[str, Meta(description='the Ray cluster: "" = start a private Ray instance on this machine for the run; "auto" = the cluster this machine joined with `ray start`; "HOST:PORT" = its head (GCS) address; "ray://HOST:10001" = through Ray Client')] = ""
    engine_cpus: Annotated[float, Meta(gt=0, le=4096, description="Ray CPUs each engine's placement-group bundle reserves")] = 1.0
    engine_gpus: Annotated[Annotated[float, Meta(ge=0, le=64)] | Literal["auto"], Meta(description='Ray GPUs per engine bundle ("auto": 1 when engines run on cuda, else 0)')] = "auto"
    engine_resources: Annotated[dict[str, Annotated[float, Meta(gt=0)]], Meta(description='custom Ray resources each engine bundle also asks for, e.g. {engines = 1} to keep engines on nodes started with `ray start --resources \'{"engines": 8}\'`')] = {}
    engine_strategy: Annotated[Literal["PACK", "SPREAD", "STRICT_SPREAD"], Meta(description="placement of the engines' bundles (one engine per bundle): PACK on as few nodes as fit, SPREAD over nodes, STRICT_SPREAD one engine per node")] = "PACK"
    trainer_cpus: Annotated[float, Meta(gt=0, le=4096, description="Ray CPUs per trainer rank")] = 1.0
    trainer_gpus: Annotated[Annotated[float, Meta(ge=0, le=64)] | Literal["auto"], Meta(description='Ray GPUs per trainer rank ("auto": 1 when the trainer runs on cuda (trainer.backend nccl, or engines on cuda), else 0)')] = "auto"
    trainer_resources: Annotated[dict[str, Annotated[float, Meta(gt=0)]], Meta(description="custom Ray resources per trainer rank, e.g. {trainer = 1}")] = {}
    trainer_ranks_per_node: Annotated[int, Meta(ge=0, le=4096, description="trainer ranks packed on one node (one STRICT_PACK bundle per node, nodes STRICT_SPREAD); 0 = all ranks on one node")] = 0
    judge_cpus: Annotated[float, Meta(gt=0, le=4096, description="Ray CPUs each judge engine's bundle reserves (judge.model set)")] = 1.0
    judge_gpus: Annotated[Annotated[float, Meta(ge=0, le=64)] | Literal["auto"], Meta(description='Ray GPUs per judge engine bundle ("auto": as engine_gpus)')] = "auto"
    judge_resources: Annotated[dict[str, Annotated[float, Meta(gt=0)]], Meta(description='custom Ray resources each judge bundle also asks for, e.g. {judges = 1}')] = {}
    judge_strategy: Annotated[Literal["PACK", "SPREAD", "STRICT_SPREAD"], Meta(description="placement of the judge engines' bundles (one judge engine per bundle), as engine_strategy")] = "PACK"
    env_cpus: Annotated[float, Meta(gt=0, le=4096, description="Ray CPUs per environment worker process (placed on any node)")] = 1.0
    placement_timeout_s: Annotated[float, Meta(gt=0, le=86400, description="seconds to wait for the placement groups (and each process's actor) to be placed; past it, a LaunchError naming what was asked")] = 120.0


class ClusterConfig(Section):
    launcher: Annotated[Literal["local", "ray", "slurm"], Meta(description="where the run's processes start: local (this machine), ray (placement groups on a Ray cluster), slurm (an sbatch script, srun per node)")] = "local"
    interface: Annotated[str, Meta(min_length=1, description='where engine and trainer sockets bind: "loopback" (ipc:// on this machine), an IP address of the node, or "auto" (the node\'s primary address); any socket off loopback is TCP secured with ZeroMQ CURVE (per-run keys)')] = "loopback"
    slurm: SlurmConfig = msgspec.field(default_factory=SlurmConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)


class Config(Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    reward: RewardModelConfig = msgspec.field(default_factory=RewardModelConfig)
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    distill: DistillConfig = msgspec.field(default_factory=DistillConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    moe: MoeConfig = msgspec.field(default_factory=MoeConfig)
    vision: VisionConfig = msgspec.field(default_factory=VisionConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


# --------------------------------------------------------------------------- loading
def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. --set rollout.group_size=4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise ConfigError(f"--set {item!r}: {key!r} is not a dotted key path")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string: --set run.name=exp1
    return key.split("."), value


def _moved_keys(data: dict[str, Any], source: str) -> None:
    """An old-shape key (flat in [algorithm]) is an error naming its new place."""
    alg = data.get("algorithm")
    if not isinstance(alg, dict):
        return
    for key in alg:
        if key in MOVED_ALGORITHM_KEYS:
            group, _, name = MOVED_ALGORITHM_KEYS[key].partition(".")
            raise ConfigError(f"{source}: algorithm.{key}: moved to [algorithm.{group}] {name} (each loss's options "
                              f"are in its own table); write it as algorithm.{group}.{name}")


def from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Validate a plain dict (parsed TOML) into a Config, or raise ConfigError naming the key."""
    _moved_keys(data, source)
    try:
        cfg = msgspec.convert(data, Config, strict=True)
    except msgspec.ValidationError as e:
        key, what = describe(str(e), Config)
        raise ConfigError(f"{source}: {key or '(top level)'}: {what}") from None
    _check(cfg, source)
    return cfg


def _check_verdict(jc: JudgeConfig, source: str) -> None:
    """[judge]'s verdict reading: the options of the other kind of verdict are a mistake, said with the fix."""
    d = JudgeConfig()
    score_keys = [k for k in ("score_pattern", "score_min", "score_max") if getattr(jc, k) != getattr(d, k)]
    pass_keys = [k for k in ("pass_pattern", "fail_pattern") if getattr(jc, k) != getattr(d, k)]
    if jc.verdict == "pass_fail" and score_keys:
        raise ConfigError(f"{source}: judge.{score_keys[0]}: set, but judge.verdict = \"pass_fail\" reads pass_pattern / "
                          "fail_pattern; set judge.verdict = \"score\" to read scores, or remove it")
    if jc.verdict == "score":
        if pass_keys:
            raise ConfigError(f"{source}: judge.{pass_keys[0]}: set, but judge.verdict = \"score\" reads score_pattern; "
                              "set judge.verdict = \"pass_fail\", or remove it")
        if not (math.isfinite(jc.score_min) and math.isfinite(jc.score_max) and jc.score_min < jc.score_max):
            raise ConfigError(f"{source}: judge.score_min = {jc.score_min} must be below judge.score_max = {jc.score_max}")
        if re.compile(jc.score_pattern).groups < 1:
            raise ConfigError(f"{source}: judge.score_pattern: {jc.score_pattern!r} has no group; put the score in "
                              "parentheses, e.g. \"Rating: (\\\\d+)\"")


def _check(cfg: Config, source: str) -> None:
    """Cross-field rules msgspec bounds cannot express."""
    alg = cfg.algorithm
    for group in LOSS_OPTIONS:
        if group != alg.loss and getattr(alg, group) != type(getattr(alg, group))():
            raise ConfigError(f"{source}: algorithm.{group}: options of loss {group!r}, but algorithm.loss = {alg.loss!r}; "
                              f"set algorithm.loss = {group!r} or remove [algorithm.{group}]")
    if alg.credit == "none" and alg.rhythm != RhythmOptions():
        raise ConfigError(f"{source}: algorithm.rhythm: options of the attention-rhythm credit, but algorithm.credit = "
                          "\"none\"; set algorithm.credit (waad, fai or rhythm) or remove [algorithm.rhythm]")
    if cfg.run.eval_engines > cfg.engine.count:
        raise ConfigError(f"{source}: run.eval_engines: {cfg.run.eval_engines} engines for evals, but engine.count = "
                          f"{cfg.engine.count}; set run.eval_engines <= engine.count (0 = all of them)")
    if cfg.trainer.backend == "nccl" and cfg.engine.device == "cpu":
        raise ConfigError(f"{source}: trainer.backend: nccl needs GPUs but engine.device is cpu; use gloo or auto")
    if cfg.model.path in ("builtin:tiny", "builtin:moe") and (cfg.model.chat_template == "on" or cfg.model.system_prompt):
        key = "model.system_prompt" if cfg.model.system_prompt else "model.chat_template"
        raise ConfigError(f"{source}: {key}: the built-in model has no chat template; use a Hugging Face model "
                          "folder with one (model.path), or leave model.chat_template = \"auto\" and model.system_prompt empty")
    build = cfg.model.build
    if build.recipe == "none" and build != ModelBuildConfig():
        raise ConfigError(f"{source}: model.build: options of a build recipe, but model.build.recipe = \"none\"; "
                          "set model.build.recipe (e.g. \"chat\") or remove [model.build]")
    if build.recipe != "none" and cfg.model.path in ("builtin:tiny", "builtin:moe"):
        raise ConfigError(f"{source}: model.build.recipe: {build.recipe!r} builds a model folder, but model.path is "
                          f"{cfg.model.path!r} (built by flashrl anyway); set model.path to the folder to build")
    if cfg.model.system_prompt and cfg.model.chat_template == "off":
        raise ConfigError(f"{source}: model.system_prompt: a system prompt needs the chat template, but "
                          "model.chat_template = \"off\"; set it to \"auto\" or remove the system prompt")
    if cfg.reward.model and cfg.judge.model:
        raise ConfigError(f"{source}: judge.model: a run has one model reward, but both reward.model and judge.model "
                          "are set; remove one of them")
    if not cfg.reward.model and not cfg.judge.model and cfg.reward != RewardModelConfig():
        raise ConfigError(f"{source}: reward: options of a reward model, but reward.model is empty; set reward.model "
                          "(\"builtin:rm\" or a sequence-classification folder) or judge.model, or remove [reward]")
    if cfg.reward.combine == "gate" and cfg.reward.model_weight <= 0:  # the gate's order (rewardmodel/suite.py)
        raise ConfigError(f"{source}: reward.model_weight: must be > 0 with combine = \"gate\" (a verifier-passed episode "
                          f"gets max(gate_reward, 0) + model_weight x u, u in [0, 1]); found {cfg.reward.model_weight}")
    if not cfg.judge.model and cfg.judge != JudgeConfig():
        raise ConfigError(f"{source}: judge: options of a judge, but judge.model is empty; set judge.model "
                          "(\"builtin:judge\" or a causal-LM folder) or remove [judge]")
    if cfg.judge.model:
        for key in ("pass_pattern", "fail_pattern", "score_pattern"):
            try:
                re.compile(getattr(cfg.judge, key))
            except re.error as e:
                raise ConfigError(f"{source}: judge.{key}: invalid regular expression: {e}") from None
        _check_verdict(cfg.judge, source)
        try:
            cfg.judge.template.format(prompt="", response="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"{source}: judge.template: {e!r}; the template takes {{prompt}} and {{response}} "
                              "(write a literal brace as {{ or }})") from None
    for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(cfg.log, key) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{source}: log.{key}: the {package} package is not installed; "
                              f"pip install 'flashrl[log]' or set log.{key} = false")
    iface = cfg.cluster.interface
    if iface not in ("loopback", "auto"):
        import ipaddress

        try:
            ipaddress.ip_address(iface)
        except ValueError:
            raise ConfigError(f"{source}: cluster.interface: {iface!r} is not an IP address; use \"loopback\", "
                              "\"auto\" or one of the node's addresses (e.g. from `hostname -I`)") from None
    from flashrl.plugins import env_name_problem  # imports no environment: names and entry points only

    distill_check(cfg, source, ConfigError)
    problem = env_name_problem(cfg.env.name)
    if problem:
        raise ConfigError(f"{source}: env.name: {problem}")


# Losses whose ratio is taken against the proximal policy only: no behaviour-policy weight per token.
UNCORRECTED_LOSSES = ("ppo", "grpo", "asyppo")


def advice(cfg: Config) -> list[str]:
    """Warnings about a valid config that probably does not do what its author wants (``flashrl validate``
    and ``flashrl run`` print them; nothing is refused)."""
    notes = []
    loss, ratio, stale = cfg.algorithm.loss, cfg.scheduler.async_ratio, cfg.scheduler.stale
    if ratio > 0 and loss in UNCORRECTED_LOSSES:
        older = (" and, with scheduler.stale = \"partial\", single tokens of a long answer older still"
                 if stale == "partial" else "")
        notes.append(
            f"algorithm.loss = {loss!r} treats asynchronous samples (up to scheduler.async_ratio = {ratio} versions "
            f"old{older}) as on-policy: no per-token behaviour correction. Use \"decoupled_ppo\" (the default), "
            "\"tis\", \"cispo\" or \"gspo\" (docs/algorithms.md), or scheduler.async_ratio = 0 "
            "(synchronous)")
    jc = cfg.judge
    if jc.model == "builtin:judge" and jc.verdict == "score" and (jc.score_min, jc.score_max) != (0.0, 1.0):
        notes.append(f"judge.verdict = \"score\" with builtin:judge, which ends each verdict with 1 (pass) or 0 (fail): "
                     f"read on [{jc.score_min:g}, {jc.score_max:g}] a pass is worth {(1 - jc.score_min) / (jc.score_max - jc.score_min):.2g}, "
                     "not 1; set judge.score_min = 0 and judge.score_max = 1, or judge.verdict = \"pass_fail\"")
    return notes


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (TOML; None = all defaults), apply ``key.path=value`` overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found (give the path to a .toml file, e.g. configs/tiny.toml)")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    for item in overrides:
        keys, value = _parse_override(item)
        set_dotted(data, keys, value, f"--set {item!r}")
    return from_dict(data, source)


def set_dotted(tree: dict[str, Any], keys: list[str], value: Any, what: str) -> None:
    """``tree[k0][k1]...[kn] = value``, creating the tables on the way (a dotted override: ``--set``, a bench
    scenario's ``set``); ConfigError ``"<what>: 'k' is a value, not a table"`` when a prefix holds a value."""
    node = tree
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{what}: {k!r} is a value, not a table")
        node = nxt
    node[keys[-1]] = value


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to runs/<name>/config.toml)."""
    lines: list[str] = []
    for section, value in msgspec.structs.asdict(cfg).items():
        lines.append(f"[{section}]")
        sub = msgspec.to_builtins(value)
        nested = {}
        for k, v in sub.items():
            if isinstance(v, dict):
                nested[k] = v
            else:
                lines.append(f"{k} = {_toml_value(v)}")
        for k, v in nested.items():
            lines.append(f"[{section}.{k}]")
            for kk, vv in v.items():
                lines.append(f"{kk} = {_toml_value(vv)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")

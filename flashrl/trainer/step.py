"""The training step over a plain ``torch.nn.Module``: the algorithm, with no process group of its own.

    PolicyTrainer (this module)                     Trainer (worker.py): the FSDP / process shell
      model: any HF causal LM (plain or FSDP2)        builds the model (FSDP2-sharded when world > 1)
      optimizer, critics, reference model             checkpoints, weight sync, request dispatch
      comm: Collectives (rank, world, all_reduce)     comm = ProcessCollectives (torch.distributed)
      train_step / compute_logprobs                   fan-out of requests to ranks 1.., RPC server

``PolicyTrainer`` runs in one process without ``init_process_group`` (``Collectives()``: rank 0 of 1,
reductions are no-ops), so the step is unit-tested as a plain class; the worker's ``Trainer`` is the
same class with torch.distributed collectives and an FSDP2-wrapped model (compare vLLM's
``EngineCore`` and ``EngineCoreProc``). Every rank runs the same phases in the same order, so the
collectives inside (FSDP all-gathers / reduce-scatters, metric reductions) line up by construction.

One training step (``train_step``), on every rank::

    TrainBatch --prepare--> full batch [B, L] (tied groups masked out with filter_ties)
       | advantages [B, T]: GRPO per sample, or (loss = asyppo) MiniCritics: I^A * GAE(V_bar), and I^H
       | x gamma [B, T] when credit != none: one no-grad eager-attention forward of the current weights,
       |   rows dealt round-robin over the ranks, gamma all-reduced (rhythm.credit_scale)
       v
    proximal: no-grad logprobs of the step's starting weights for mini-batches 2.. (mini-batch 1's own
       forward sees those weights, so its detached logprobs serve: one forward fewer), and reference
       logprobs (kl_coef > 0)
       v
    update, per mini-batch: per micro-batch forward + compute_policy_loss + backward; clip, optimizer step
       v
    metrics: loss sums / token-weighted means / maxima reduced over the ranks, mismatch, critics update
       (asyppo: every rank holds an identical critic replica, fed the same batch)

Each phase's wall time is in the step's metrics as ``time/trainer/<phase>_s`` (batch, credit,
proximal, forward, backward, optimizer, metrics, critics; ``flashrl bench steptime`` reads them); on a
GPU the timer synchronizes the device at phase boundaries so the time lands in the phase that spent it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from flashrl.config import Config
from flashrl.core.lr_schedule import scheduled_lr
from flashrl.moe.replay import RouteReplay
from flashrl.trainer import advantages
from flashrl.trainer.advantages import count_groups, grpo_advantages, tied_groups, token_advantages
from flashrl.trainer.batch import PaddedBatch, pad_batch, split_prefixes, token_logprobs, with_images
from flashrl.trainer.critics import MiniCritics
from flashrl.trainer.distill import forward_kl, forward_with_top
from flashrl.trainer.forward import shared_prefix_logprobs
from flashrl.trainer.lora import adapter_dropout, dropout_modules, is_lora, reference_disabled
from flashrl.trainer.losses import compute_policy_loss
from flashrl.trainer.rhythm import credit_scale
from flashrl.vision.batch import PixelCache
from flashrl.wire.protocol import TrainBatch, TrainResult
from flashrl.wire.trajectory import Trajectory

MicroBatchPlan = list[tuple[torch.Tensor, list[torch.Tensor]]]  # per mini-batch: (its sample indices, this rank's micro-batches)


def plan_micro_batches(n: int, world: int, rank: int, mini_batches: int, micro_batch: int,
                       order: torch.Tensor | None = None) -> MicroBatchPlan:
    """Per mini-batch: its sample indices, and ``rank``'s micro-batches (index tensors, maybe empty).

    Mini-batches are contiguous slices of ``order`` (default: the batch in order, so groups stay
    together; ``shuffle_order`` deals them at random); a mini-batch's samples go to ranks round-robin.
    Every rank gets the same number of micro-batches (the busiest rank's), because each forward is a
    collective; a rank short of samples runs a fully masked one.
    """
    plan = []
    for mini in torch.tensor_split(torch.arange(n) if order is None else order, min(mini_batches, n)):
        mine = mini[rank::world]
        n_micro = max(1, math.ceil(math.ceil(len(mini) / world) / micro_batch))
        plan.append((mini, [mine[k * micro_batch : (k + 1) * micro_batch] for k in range(n_micro)]))
    return plan


# Losses whose every term is the advantage times something: a sample whose advantages are all 0 adds exactly
# 0 to the loss and to the gradient (topr weighs by the reward, asyppo's critics learn from every sample).
ADVANTAGE_ONLY_LOSSES = frozenset({"ppo", "grpo", "decoupled_ppo", "tis", "cispo", "gspo"})


def drop_inert(plan: MicroBatchPlan, inert: torch.Tensor) -> MicroBatchPlan:
    """``plan`` without the ``inert`` samples [B] in its micro-batches; mini-batches (their loss divisors) and the
    number of micro-batches (each forward is a collective) stay as they are: an emptied micro-batch runs masked."""
    return [(mini, [idx[~inert[idx]] for idx in micros]) for mini, micros in plan]


def shuffle_order(n: int, seed: int, step: int) -> torch.Tensor:
    """``trainer.shuffle``: the order samples are dealt into mini-batches at ``step``; the same on every rank
    (a function of the run's seed and the step only, so a resumed run deals as the original did)."""
    key = zlib.crc32(f"{seed}:{step}".encode())
    return torch.randperm(n, generator=torch.Generator().manual_seed(key))


class Collectives:
    """What a step needs across data-parallel ranks. This one is a single rank: reductions are no-ops.

    The process shell passes ``ProcessCollectives`` (worker.py), which reduces over torch.distributed.
    """

    rank = 0
    world = 1

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """Reduce ``t`` in place over the ranks (``op``: "sum" or "max")."""


class PhaseTimer:
    """Wall time per named phase of one step, summed over repeats (``time/trainer/<phase>_s``)."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = device.type == "cuda"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"time/trainer/{k}_s": v for k, v in self.seconds.items()}


class Mismatch:
    """Train/inference mismatch of one step: the engines' behaviour logprobs against the trainer's own.

    Over the step's on-policy response tokens (sampled by the weights the step starts from: version ==
    step), compared with the trainer's first-pass (proximal) logprobs of the same tokens before the
    update. ``mismatch/kl``: mean k3 estimate of KL(engine || trainer), exp(d) - 1 - d with d = trainer -
    engine logprob (tokens were drawn from the engine); ``mismatch/max_abs``: largest |d|;
    ``mismatch/tokens``: tokens compared (none: no keys); ``mismatch/mean_abs``: mean |d|; ``mismatch/ratio_std``: std of exp(d).
    Near 0 when engines and trainer hold the same weights and score the same distribution; a weight
    that did not sync, a wrong weight name or a different temperature shows up here at once. With
    rollout.top_p < 1 it also holds the mass top-p cut off (engine logprobs are renormalized).
    """

    def __init__(self) -> None:
        self.sums = torch.zeros(5, dtype=torch.float64)  # k3 KL, tokens, |d|, exp(d), exp(d)^2 (summed)
        self.max_abs = 0.0

    def add(self, trainer_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, versions: torch.Tensor,
            version: int) -> None:
        with torch.no_grad():
            on = (mask > 0) & (versions == version)
            d = (trainer_logp.detach() - behav_logp)[on].to(torch.float64).clamp(-30.0, 30.0)
            r = torch.exp(d)
            self.sums += torch.stack([(torch.expm1(d) - d).sum(), torch.ones_like(d).sum(), d.abs().sum(), r.sum(), (r * r).sum()]).cpu()
            self.max_abs = max(self.max_abs, float(d.abs().amax())) if d.numel() else self.max_abs

    def reduce(self, device: torch.device, comm: Collectives) -> dict[str, float]:
        """Sums and max over the ranks (every rank calls it); the metrics, identical on every rank."""
        sums, mx = self.sums.clone(), torch.tensor([self.max_abs], dtype=torch.float64)
        if comm.world > 1:
            sums, mx = sums.to(device), mx.to(device)
            comm.all_reduce(sums)
            comm.all_reduce(mx, op="max")
        kl, n, ab, r1, r2 = sums.tolist()
        if n == 0:
            return {}
        return {"mismatch/kl": kl / n, "mismatch/max_abs": float(mx[0]), "mismatch/tokens": n, "mismatch/mean_abs": ab / n,
                "mismatch/ratio_std": max(r2 / n - (r1 / n) ** 2, 0.0) ** 0.5}


@dataclasses.dataclass
class Prepared:
    """A batch ready for the update: padded, advantages filled (after ties, critics and credit)."""

    full: PaddedBatch
    tied: torch.Tensor  # [B] bool: the sample's group has one reward for every member
    extra: dict[str, float]  # critic and credit metrics (whole batch, the same on every rank)
    ent_mask: torch.Tensor | None = None  # AsyPPO's I^H [B, T]
    returns: torch.Tensor | None = None  # AsyPPO's critic regression targets [B, T]


@dataclasses.dataclass
class Accumulated:
    """Per-rank metric accumulators of the update phase (reduced over the ranks afterwards)."""

    sums: dict[str, float] = dataclasses.field(default_factory=dict)  # loss/*: each micro carries norm / R
    weighted: dict[str, float] = dataclasses.field(default_factory=dict)  # token-weighted means
    maxes: dict[str, float] = dataclasses.field(default_factory=dict)
    tokens: float = 0.0
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    mismatch: Mismatch = dataclasses.field(default_factory=Mismatch)
    # per sample of the batch: sum and count of pi_prox / pi_behav over its generated tokens (this rank's rows)
    iw: torch.Tensor | None = None  # [2, B] float64, on the CPU

    def add_iw(self, rows: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor, versions: torch.Tensor) -> None:
        """Add the behaviour weights of ``rows`` (global row ids) from their micro-batch tensors [b, T]."""
        assert self.iw is not None
        gen = versions >= 0  # generated tokens (observation and padding: -1), whatever filter_ties masked
        d = (prox_logp.detach() - behav_logp).to(torch.float64).clamp(-30.0, 30.0)
        w = torch.where(gen, torch.exp(d), torch.zeros_like(d))
        self.iw[0].index_add_(0, rows.cpu(), w.sum(-1).cpu())
        self.iw[1].index_add_(0, rows.cpu(), gen.sum(-1).to(torch.float64).cpu())

    def sample_iw(self, device: torch.device, comm: Collectives) -> list[float | None]:
        """Every sample's mean behaviour weight (every rank calls it: each row was scored on one rank)."""
        assert self.iw is not None
        iw = self.iw
        if comm.world > 1:
            iw = iw.to(device)  # nccl reduces device tensors
            comm.all_reduce(iw)
            iw = iw.cpu()
        return [float(s) / float(n) if n > 0 else None for s, n in zip(iw[0].tolist(), iw[1].tolist())]


class PolicyTrainer:
    """The policy (any HF causal LM module), its optimizer and the training step; no process group needed.

    ``model`` and ``ref_model`` may be plain modules (one rank) or FSDP2-wrapped ones (``comm`` then
    reduces over the ranks, and every rank must call ``train_step`` / ``compute_logprobs`` with the
    same input in the same order). ``version`` counts the optimizer-applied steps (TrainBatch.step + 1).
    """

    def __init__(self, cfg: Config, model: torch.nn.Module, device: torch.device, *,
                 ref_model: torch.nn.Module | None = None, comm: Collectives | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.ref_model = ref_model
        # The KL anchor (algorithm.kl_coef > 0): ``ref_model``, a frozen copy of the initial weights; with
        # LoRA the base model is the initial policy and never trains, so the reference is ``model`` with its
        # adapters bypassed (no second copy of the weights).
        self.has_ref = ref_model is not None or (cfg.algorithm.kl_coef > 0 and is_lora(model))
        self.device = device
        self.comm = comm or Collectives()
        self.rank, self.world = self.comm.rank, self.comm.world
        self.version = 0
        self.temperature = cfg.rollout.temperature  # training rollouts' sampling temperature
        mc: Any = model.config  # a Hugging Face config (torch types module attributes as Tensor | Module)
        self.tie_word_embeddings = bool(getattr(mc, "tie_word_embeddings", False))
        pad = mc.pad_token_id if mc.pad_token_id is not None else mc.eos_token_id
        self.pad_id = int(pad if isinstance(pad, int) else (pad[0] if pad else 0))
        # foreach: one fused kernel per op over every parameter instead of a Python loop per tensor
        # (a third of the optimizer's time on the tiny model); same arithmetic.
        # Only the parameters that train: every one in full fine-tuning, the adapter's with LoRA (whose
        # checkpoints then hold optimizer state for the adapter alone).
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay, foreach=True
        )
        # AsyPPO: an identical replica on every rank (same seed), with its own optimizer; not FSDP-wrapped.
        self.critics: MiniCritics | None = None
        if cfg.algorithm.loss == "asyppo":
            self.critics = MiniCritics(int(mc.vocab_size), cfg.algorithm, seed=cfg.run.seed).to(device)
        # LoRA's adapter-input dropout (model.lora.dropout > 0): on in the gradient forwards only. The model
        # otherwise stays in eval mode, so the proximal, reference and ComputeLogprobs logprobs are the
        # engines' (no dropout), and mini-batch 1 then needs a proximal pass of its own (_proximal).
        self.dropouts = dropout_modules(model)
        self.moe = RouteReplay.of(model, cfg.moe.replay)  # a MoE: routing replay and its metrics (flashrl/moe/replay.py)
        self.pixels: PixelCache | None = None  # a VLM's image processor's cache (vision/batch.py), the worker's
        self.logit_bias: torch.Tensor | None = None  # [V]: -100 at a VLM's banned image tokens (the engines' bias)

    # ------------------------------------------------------------------ forward
    def forward_logprobs(self, model: torch.nn.Module, b: PaddedBatch, entropy_grad: bool = False,
                         temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [B, T] of ``b``'s targets under ``model`` (and entropies), at the sampling temperature.

        The one recomputation behind the current, proximal and reference logprobs and ComputeLogprobs:
        scored under softmax(logits / T) with T = ``rollout.temperature`` (what the engines sampled
        training rollouts at, batch.sampling_temperature) unless ``temperature`` is given, so a ratio to
        the engines' behaviour logprobs compares one distribution. With FSDP every rank calls it.
        """
        t = self.temperature if temperature is None else temperature
        routed = self.moe is not None and model is self.model and b.routes.shape[-1] > 0  # forwarded whole: no split
        vision = b.vision_kwargs()  # a VLM's images: every forward takes them (forwarded whole: no split)
        banned = self.logit_bias is not None  # a VLM's engines ban its image tokens in every request: so does this
        split = split_prefixes(b, self.pad_id) if self.cfg.trainer.share_prefix and not (routed or vision or banned) else None
        if split is None:
            with self._routing(model, b):
                out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False, **vision)
            logits = out.logits[:, :-1] + self.logit_bias if banned else out.logits[:, :-1]
            return token_logprobs(logits, b.targets, entropy_grad=entropy_grad, temperature=t)
        return shared_prefix_logprobs(model, b, split.to(b.input_ids.device), entropy_grad, t)

    def _routing(self, model: torch.nn.Module, b: PaddedBatch) -> Any:
        """A MoE policy's forward of ``b`` with its replayed routes forced (flashrl/moe/replay.py), else nothing."""
        routed = self.moe is not None and model is self.model and b.routes.shape[-1] > 0
        return self.moe.forcing(b.routes, b.input_ids.shape[1]) if routed else contextlib.nullcontext()  # type: ignore[union-attr]

    @staticmethod
    def _micro(full: PaddedBatch, mini: torch.Tensor, idx: torch.Tensor) -> PaddedBatch:
        if len(idx):
            return full.select(idx)
        dummy = full.select(mini[:1])  # keeps this rank in the collectives; contributes nothing
        return dataclasses.replace(dummy, loss_mask=torch.zeros_like(dummy.loss_mask))

    @staticmethod
    def _rows(t: torch.Tensor | None, mini: torch.Tensor, idx: torch.Tensor, width: int) -> torch.Tensor | None:
        """A [B, T] tensor cut like ``_micro`` cuts the batch (same rows, trimmed to ``width``)."""
        if t is None:
            return None
        return t[idx if len(idx) else mini[:1], :width]

    # ------------------------------------------------------------------ train
    def train_step(self, tb: TrainBatch) -> TrainResult | None:
        """One training step (module docstring); the result on rank 0, None on the others.

        Metrics beyond compute_policy_loss's: advantage/* over the response tokens of the advantages
        the loss used (GRPO or critic, after credit scaling); critic/* (asyppo: value_mean, sigma_mean,
        adv_masked_frac, ent_masked_frac, loss); credit/* (credit != none: amplified_frac = share of
        response tokens with gamma > 1, gamma_mean); time/trainer/<phase>_s."""
        t0 = time.perf_counter()
        timer = PhaseTimer(self.device)
        prep = self._prepare(tb, timer)
        if self.moe is not None:  # routing disagreement measured; r2: the trainer's own routes (flashrl/moe/replay.py)
            with timer.phase("routes"):
                prep.full = self.moe.prepare(prep.full, lambda b: self.forward_logprobs(self.model, b.to(self.device)),
                                             self.cfg.trainer.micro_batch, tb.step)
        order = shuffle_order(prep.full.size, self.cfg.run.seed, tb.step) if self.cfg.trainer.shuffle else None
        plan = plan_micro_batches(prep.full.size, self.world, self.rank, self.cfg.trainer.mini_batches,
                                  self.cfg.trainer.micro_batch, order)
        inert = self._inert(prep)
        if inert is not None:
            plan = drop_inert(plan, inert)
        lr = scheduled_lr(self.cfg.trainer, self.cfg.run.steps, tb.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # a function of the step, not scheduler state, so a resumed run continues it
        with timer.phase("proximal"):
            prox, ref = self._proximal(prep.full, plan)
        acc = self._update(prep, plan, prox, ref, tb.step, timer)
        with timer.phase("metrics"):
            metrics = self._reduce(acc)
            metrics.update(acc.mismatch.reduce(self.device, self.comm))
            metrics.update(self.moe.metrics(self.comm, self.device) if self.moe is not None else {})
            sample_iw = acc.sample_iw(self.device, self.comm)
        if self.critics is not None and prep.returns is not None:
            with timer.phase("critics"):
                # after the policy step, as AsyPPO orders it; every rank updates its replica identically
                dev = prep.full.to(self.device)
                prep.extra.update(self.critics.update(dev.input_ids, dev.attention_mask, dev.loss_mask, prep.returns,
                                                      dev.groups))
        self.version = tb.step + 1
        if self.rank != 0:
            return None
        with timer.phase("metrics"):
            metrics.update(self._batch_metrics(prep, acc, len(plan), lr))
            metrics["loss"] = metrics.get("loss/total", 0.0)
        metrics.update(timer.metrics())
        metrics["step_time_s"] = time.perf_counter() - t0
        return TrainResult(step=tb.step, metrics=metrics, sample_iw=sample_iw)

    def _prepare(self, tb: TrainBatch, timer: PhaseTimer) -> Prepared:
        """Pad the batch, mask tied groups (filter_ties), fill the advantages (GRPO or critics, x credit)."""
        alg = self.cfg.algorithm
        with timer.phase("batch"):
            skipped: list[int] = []  # a VLM's pixels; samples whose images this rank cannot process: out of the loss
            full = with_images(pad_batch(tb.samples, self.pad_id), self.pixels, tb.samples, skipped)
            tied = tied_groups(full.rewards, full.groups)
            if alg.filter_ties and not self.cfg.distill.on:  # distilling, a tied group still has its teacher's signal
                full = dataclasses.replace(full, loss_mask=full.loss_mask * (~tied).unsqueeze(-1))
            prep = Prepared(full=full, tied=tied, extra={"vision/skipped_bad_image": len(skipped)} if skipped else {})
            if self.critics is not None:
                dev = full.to(self.device)
                targets = self.critics.advantages_and_masks(dev.input_ids, dev.attention_mask, dev.loss_mask,
                                                            dev.rewards)
                adv_tok, prep.ent_mask, prep.returns = targets.advantages.cpu(), targets.entropy_mask.cpu(), targets.returns
                prep.extra.update(targets.metrics)
            else:
                adv_tok = token_advantages(grpo_advantages(full.rewards, full.groups, scale_std=alg.scale_std),
                                           full.loss_mask)
        if alg.credit != "none":
            with timer.phase("credit"):
                gamma = self._credit(full, adv_tok)
                adv_tok = adv_tok * gamma
                resp = full.loss_mask > 0
                n_resp = max(int(resp.sum()), 1)
                prep.extra["credit/amplified_frac"] = float(((gamma > 1) & resp).sum()) / n_resp
                prep.extra["credit/gamma_mean"] = float(gamma[resp].sum()) / n_resp
        if self.cfg.distill.on:  # the teacher's per-token term (flashrl/distill)
            adv_tok = advantages.distill_step(full, adv_tok, self.cfg.distill, prep.extra)
        prep.full = dataclasses.replace(full, advantages=adv_tok)
        return prep

    def _inert(self, prep: Prepared) -> torch.Tensor | None:
        """``trainer.skip_inert``: the samples [B] whose loss and gradient are exactly zero (every advantage on
        their loss tokens 0, or no loss token), or None where the loss could still move them. The mini-batch
        divisors (``_norm``) still count them, so the update is the one the whole batch gives."""
        alg = self.cfg.algorithm
        if (not self.cfg.trainer.skip_inert or alg.loss not in ADVANTAGE_ONLY_LOSSES or alg.entropy_coef > 0
                or alg.kl_coef > 0 or self.critics is not None):
            return None
        full = prep.full
        return ((full.advantages * full.loss_mask) == 0).all(dim=-1)

    def _credit(self, full: PaddedBatch, adv_tok: torch.Tensor) -> torch.Tensor:
        """gamma [B, T] (CPU) for ``algorithm.credit``, from the current weights.

        gamma is per sample (rhythm ranks tokens within a row), so the rows are dealt round-robin over
        the ranks, each forwards its own in chunks of ``trainer.micro_batch`` (the same number of
        forwards on every rank: they are FSDP collectives; a rank short of rows forwards a row it then
        discards), and a sum all-reduce assembles the whole gamma on every rank.
        """
        alg, chunk = self.cfg.algorithm, self.cfg.trainer.micro_batch
        b, t = full.loss_mask.shape
        mine = torch.arange(b)[self.rank :: self.world]
        n_chunks = max(1, math.ceil(math.ceil(b / self.world) / chunk))
        gamma = torch.zeros(b, t, dtype=torch.float32, device=self.device)
        for k in range(n_chunks):
            idx = mine[k * chunk : (k + 1) * chunk]
            sub = full.select(idx if len(idx) else torch.arange(1)).to(self.device)
            w = sub.loss_mask.shape[1]
            adv = adv_tok[idx if len(idx) else torch.arange(1), :w].to(self.device)
            g = credit_scale(self.model, sub.input_ids, sub.attention_mask, sub.loss_mask, alg, advantages=adv,
                             chunk=chunk)
            if len(idx):
                gamma[idx.to(self.device)] = torch.nn.functional.pad(g.float(), (0, t - w), value=1.0)
        if self.world > 1:
            self.comm.all_reduce(gamma)  # each row is non-zero on exactly one rank
        return gamma.cpu()

    def _proximal(self, full: PaddedBatch, plan: MicroBatchPlan) -> tuple[dict[tuple[int, int], torch.Tensor],
                                                                 dict[tuple[int, int], torch.Tensor]]:
        """No-grad logprobs of the step's starting weights: proximal (mini-batches 2..) and reference.

        Mini-batch 1 needs no proximal pass: no optimizer step has run before its forwards, so their
        own detached logprobs are the proximal ones (``_update`` uses them), unless adapter dropout is on
        (those forwards then are not the engines' policy: mini-batch 1 gets a no-dropout pass too)."""
        prox: dict[tuple[int, int], torch.Tensor] = {}
        ref: dict[tuple[int, int], torch.Tensor] = {}
        first = bool(self.dropouts)  # mini-batch 1's proximal logprobs need their own pass
        if len(plan) == 1 and not self.has_ref and not first:
            return prox, ref
        with torch.no_grad():
            for i, (mini, micros) in enumerate(plan):
                if i == 0 and not self.has_ref and not first:
                    continue
                for k, idx in enumerate(micros):
                    b = self._micro(full, mini, idx).to(self.device)
                    if i > 0 or first:
                        prox[i, k] = self.forward_logprobs(self.model, b, False)[0]
                    if self.has_ref:
                        ref[i, k] = self.reference_logprobs(b)
        return prox, ref

    def reference_logprobs(self, b: PaddedBatch) -> torch.Tensor:
        """The KL anchor's logprobs of ``b`` (no grad): ``ref_model``'s, or with LoRA the base model's."""
        with torch.no_grad():
            if self.ref_model is not None:
                return self.forward_logprobs(self.ref_model, b, False)[0]
            with reference_disabled(self.model):
                return self.forward_logprobs(self.model, b, False)[0]

    def _norm(self, full: PaddedBatch, mini: torch.Tensor) -> float:
        """The mini-batch's loss divisor across all ranks (tokens, sequences or B*T; losses.aggregate)."""
        m = full.loss_mask[mini]
        agg = self.cfg.algorithm.loss_agg
        if agg == "token-mean":
            n = float(m.sum())
        elif agg == "seq-mean-token-mean":
            n = float((m.sum(-1) > 0).sum())
        else:  # seq-mean-token-sum-norm: a constant length (the batch's), so no length bias
            n = float(len(mini) * full.loss_mask.shape[-1])
        return max(n, 1.0)

    def _update(self, prep: Prepared, plan: MicroBatchPlan, prox: dict[tuple[int, int], torch.Tensor],
                ref: dict[tuple[int, int], torch.Tensor], current: int, timer: PhaseTimer) -> Accumulated:
        """Per mini-batch: forward + loss + backward per micro-batch, then clip and one optimizer step."""
        alg, full = self.cfg.algorithm, prep.full
        entropy_grad = alg.entropy_coef > 0
        fkl = self.cfg.distill.forward_kl_coef if self.cfg.distill.on else 0.0
        acc = Accumulated(iw=torch.zeros((2, full.size), dtype=torch.float64))
        # The parameters the optimizer steps, not model.parameters(): while an FSDP2 group is unsharded
        # (the root group stays unsharded after a no-grad proximal forward) the module exposes its
        # unsharded tensors, whose gradients FSDP moves to the sharded parameters; clipping those
        # would miss the root group (embeddings, final norm) from both the norm and the clip.
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
        for i, (mini, micros) in enumerate(plan):
            # FSDP2 averages gradients over ranks, so each rank divides by norm / R: the sum is the batch mean.
            norm = self._norm(full, mini) / self.world
            for k, idx in enumerate(micros):
                with timer.phase("forward"):
                    b = self._micro(full, mini, idx).to(self.device)
                    em = self._rows(prep.ent_mask, mini, idx, b.loss_mask.shape[1])
                    with adapter_dropout(self.dropouts):
                        if fkl:  # the forward-KL term needs each position's distribution (trainer/distill.py)
                            with self._routing(self.model, b):
                                logp, entropy, s_top = forward_with_top(self.model, b, entropy_grad, self.temperature)
                        else:
                            logp, entropy = self.forward_logprobs(self.model, b, entropy_grad)
                    # the weights at the start of the step, without dropout (mini-batch 1: this very forward
                    # when it has no dropout)
                    prox_logp = prox[i, k] if (i, k) in prox else logp.detach()
                    acc.mismatch.add(prox_logp, b.behav_logp, b.loss_mask, b.versions, current)
                    if len(idx):
                        acc.add_iw(idx, prox_logp, b.behav_logp, b.versions)
                    loss, met = compute_policy_loss(
                        alg,
                        logp=logp,
                        prox_logp=prox_logp,
                        behav_logp=b.behav_logp,
                        advantages=b.advantages,
                        mask=b.loss_mask,
                        rewards=b.rewards,
                        entropy=entropy,
                        ref_logp=ref.get((i, k)),
                        entropy_mask=em.to(self.device) if em is not None else None,
                        norm=norm,
                    )
                    if fkl:
                        f_loss, f_met = forward_kl(s_top, b, norm)
                        loss, met = loss + fkl * f_loss, met | f_met
                with timer.phase("backward"):
                    loss.backward()
                n_tok = float(b.loss_mask.sum())
                acc.tokens += n_tok
                for key, v in met.items():
                    if key.startswith("loss/"):
                        acc.sums[key] = acc.sums.get(key, 0.0) + v / len(plan)
                    elif key.endswith("/max"):
                        acc.maxes[key] = max(acc.maxes.get(key, -math.inf), v) if n_tok else acc.maxes.get(key, -math.inf)
                    else:
                        acc.weighted[key] = acc.weighted.get(key, 0.0) + v * n_tok
            with timer.phase("optimizer"):
                acc.grad_norms.append(self._clip(params))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        return acc

    def _clip(self, params: list[torch.nn.Parameter]) -> float:
        """Clip to ``trainer.grad_clip`` (0: only measure); the global norm over every rank's shard."""
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        if hasattr(total, "full_tensor"):  # a DTensor: the norm of the sharded gradients, made whole
            total = total.full_tensor()
        if self.cfg.trainer.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.trainer.grad_clip, total)
        return float(total)

    def _reduce(self, acc: Accumulated) -> dict[str, float]:
        """Combine per-rank metrics: loss sums / R, token-weighted means, maxima. Keys match on every
        rank because every rank ran the same loss with the same optional inputs (checked: a crc of the
        key names is reduced with the values)."""
        ks, kw, km = sorted(acc.sums), sorted(acc.weighted), sorted(acc.maxes)
        flat = torch.tensor([acc.sums[k] for k in ks] + [acc.weighted[k] for k in kw] + [acc.tokens],
                            dtype=torch.float64)
        mx = torch.tensor([acc.maxes[k] for k in km], dtype=torch.float64)
        if self.world > 1:
            crc = float(zlib.crc32(" ".join(ks + kw + km).encode()))
            flat, mx = flat.to(self.device), torch.cat([mx, torch.tensor([crc, -crc], dtype=torch.float64)]).to(self.device)
            self.comm.all_reduce(flat)
            self.comm.all_reduce(mx, op="max")
            if float(mx[-1]) != -float(mx[-2]):  # max(crc) != min(crc): seen identically on every rank
                raise RuntimeError("trainer ranks returned different metric keys; the loss must not branch on data")
            flat, mx = flat.cpu(), mx[:-2].cpu()
        out = {k: float(flat[j]) / self.world for j, k in enumerate(ks)}
        total_tok = float(flat[-1])
        out.update({k: float(flat[len(ks) + j]) / max(total_tok, 1.0) for j, k in enumerate(kw)})
        out.update({k: float(mx[j]) if math.isfinite(float(mx[j])) else 0.0 for j, k in enumerate(km)})
        return out

    def _batch_metrics(self, prep: Prepared, acc: Accumulated, optimizer_steps: int, lr: float) -> dict[str, float]:
        """Rank 0's whole-batch metrics: rewards, the advantages the loss used, counts, grad norm."""
        alg, full = self.cfg.algorithm, prep.full
        m = full.loss_mask > 0
        used = full.advantages[m].to(torch.float64)  # what the loss saw: GRPO or critic, x gamma
        out = dict(prep.extra)
        out.update({
            "grad_norm": sum(acc.grad_norms) / len(acc.grad_norms),
            "reward/mean": float(full.rewards.mean()),
            "reward/std": float(full.rewards.std(correction=0)),
            "advantage/mean": float(used.mean()) if used.numel() else 0.0,
            "advantage/std": float(used.std(correction=0)) if used.numel() else 0.0,
            "advantage/min": float(used.min()) if used.numel() else 0.0,
            "advantage/max": float(used.max()) if used.numel() else 0.0,
            "samples": float(full.size),
            "tokens": float(m.sum()),
            "groups": float(count_groups(full.groups)),
            "groups/tied": float(count_groups(full.groups, prep.tied)),
            "groups/filtered": float(count_groups(full.groups, prep.tied)) if alg.filter_ties else 0.0,
            "optimizer_steps": float(optimizer_steps),
            "lr": lr,
        })
        return out

    # ------------------------------------------------------------------ logprobs
    def compute_logprobs(self, prompt_ids: list[int], response_ids: list[int],
                         temperature: float | None = None) -> list[float]:
        """Logprob of each response token given the prompt, current weights (every rank forwards), at
        ``temperature`` (None: rollout.temperature), as ``forward_logprobs`` scores it in a train step."""
        r = len(response_ids)
        sample = Trajectory(prompt_ids=prompt_ids, response_ids=response_ids, loss_mask=[1] * r,
                             behav_logp=[0.0] * r, versions=[0] * r, reward=0.0, group=0)
        b = pad_batch([sample], self.pad_id).to(self.device)
        with torch.no_grad():
            logp, _ = self.forward_logprobs(self.model, b, False, temperature)
        p = len(prompt_ids)
        return [float(x) for x in logp[0, p - 1 : p - 1 + r].cpu()]

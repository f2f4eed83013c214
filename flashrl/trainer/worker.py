"""One trainer rank: an FSDP2-sharded Hugging Face causal LM, driven by the controller through rank 0.

    controller --TrainerRequest (ZeroMQ)--> rank 0 RpcServer (asyncio, main thread)
                                              | Ping: answered at once (Pong(version)), never queued
                                              | anything else: one at a time (lock), on the compute thread
                                              v
        rank 0 compute thread: broadcast(msgspec bytes as a uint8 tensor) ---> ranks 1..R-1 (main thread)
                               Trainer.execute(msg)  <-- same collectives, same order -->  Trainer.execute(msg)
                                              |
    controller <--TrainerReply-- rank 0 (only rank 0's result is sent back)

Every rank runs the same request through ``Trainer.execute``, so the collectives inside (FSDP
all-gathers and reduce-scatters, metric reductions, state-dict gathers, DCP saves) line up by
construction. Requests only rank 0 acts on (Ping, InitWeightSync, SendWeights) are not broadcast.
While idle, rank 0 broadcasts a Ping every ``KEEPALIVE_S`` so the other ranks' pending receive never
hits the process-group timeout during a long rollout phase. Ranks 1.. poll that receive (async_op +
short sleeps) instead of blocking in C++, so SIGTERM is handled at once.

The process group backend is ``trainer.backend`` (auto: nccl with CUDA, else gloo); the same code
runs both. On CPU the weights are float32; on GPU a non-float32 ``model.dtype`` becomes FSDP2's
compute dtype (MixedPrecisionPolicy) with float32 master weights and gradient reduction.

Entry point (exactly the env vars torchrun sets, so torchrun can launch it on a cluster)::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 LOCAL_RANK=0 \\
        python -m flashrl.trainer.worker --config run.toml --address tcp://127.0.0.1:5555 --model PATH

One training step (``Trainer.train_step``), on every rank::

    TrainBatch --pad_batch--> full batch [B, L] (tied groups masked out with filter_ties)
       | advantages [B, T]: GRPO per sample, or (loss = asyppo) MiniCritics: I^A * GAE(V_bar), and I^H
       | x gamma [B, T] when credit != none: one no-grad eager-attention forward of the current weights,
       |   rows dealt round-robin over the ranks, gamma all-reduced (rhythm.credit_scale)
       v
    per mini-batch: proximal/reference logprobs, then per micro-batch forward + compute_policy_loss +
       backward; clip, optimizer step
       v
    (asyppo) MiniCritics.update on the whole batch: every rank holds an identical critic replica, fed
       the same batch, so no collective keeps them equal

Limits: an error raised on every rank before any collective (a malformed batch) is a per-request
Error; an error on one rank in the middle of collectives leaves the others waiting until the process
group times out, and the client sees a dead rank. The critic replicas stay identical only if their
kernels are deterministic (true on the CPU; on GPUs they may drift apart by rounding, harmlessly).
Credit switches the policy (FSDP2-wrapped) to eager attention for its forward; HF returns every
layer's L x L maps at once, so that forward runs ``trainer.micro_batch`` samples at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flashrl import protocol
from flashrl.checkpoint import fsync_dir
from flashrl.config import Config, load
from flashrl.procs import child_init
from flashrl.protocol import (
    ComputeLogprobs,
    Error,
    InitWeightSync,
    Logprobs,
    Msg,
    Ok,
    Ping,
    Pong,
    PrepareWeights,
    SaveCheckpoint,
    SaveModel,
    SendWeights,
    Shutdown,
    TrainBatch,
    TrainResult,
    TrainSample,
    TrainStep,
    WeightManifest,
)
from flashrl.rendezvous import init_default_group
from flashrl.trainer.advantages import count_groups, grpo_advantages, tied_groups, token_advantages
from flashrl.trainer.batch import PaddedBatch, pad_batch, token_logprobs
from flashrl.trainer.critics import MiniCritics
from flashrl.trainer.losses import compute_policy_loss
from flashrl.trainer.rhythm import credit_scale

log = logging.getLogger("flashrl.trainer")

KEEPALIVE_S = 60.0  # idle broadcast period; far below the process group's 30 min default timeout
_RANK0_ONLY = (Ping, InitWeightSync, SendWeights)
CHECKPOINT_META = "trainer.json"


def resolve_backend(backend: str) -> str:
    """``trainer.backend``: auto -> nccl when CUDA is available, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("trainer.backend = nccl but CUDA is not available here; use auto or gloo")
    return backend


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks to shard one by one: the classes HF marks as not splittable (Qwen2DecoderLayer, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(f"{type(model).__name__}: no decoder layers found (_no_split_modules={sorted(names)}); "
                           "FSDP2 needs the per-layer blocks to shard")
    return layers


def warmup_lr(lr: float, warmup_steps: int, step: int) -> float:
    """``trainer.warmup_steps``: training step ``step`` (from 0) uses lr * min(1, (step + 1) / warmup_steps).

    A fresh AdamW's first updates on a warm-started model are large relative to its noisy early
    gradients; ramping the lr keeps the first RL steps from undoing the warm-start."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else lr


def plan_micro_batches(n: int, world: int, rank: int, mini_batches: int,
                       micro_batch: int) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Per mini-batch: its sample indices, and ``rank``'s micro-batches (index tensors, maybe empty).

    Mini-batches are contiguous slices of the batch (groups stay together); a mini-batch's samples go
    to ranks round-robin. Every rank gets the same number of micro-batches (the busiest rank's),
    because each forward is a collective; a rank short of samples runs a fully masked one.
    """
    plan = []
    for mini in torch.tensor_split(torch.arange(n), min(mini_batches, n)):
        mine = mini[rank::world]
        n_micro = max(1, math.ceil(math.ceil(len(mini) / world) / micro_batch))
        plan.append((mini, [mine[k * micro_batch : (k + 1) * micro_batch] for k in range(n_micro)]))
    return plan


class Trainer:
    """One rank's model, optimizer and request handlers. Needs an initialized default process group.

    ``execute`` must be called on every rank with the same message in the same order; it returns the
    reply on rank 0 (None elsewhere, and None for requests rank 0 answers without a reply).
    """

    def __init__(self, cfg: Config, model_path: str, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model_path = model_path
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = device
        self.version = 0
        self.temperature = cfg.rollout.temperature  # training rollouts' sampling temperature
        self.mesh = init_device_mesh(device.type, (self.world,))
        mp = None
        if device.type == "cuda" and cfg.model.dtype != "float32":
            compute = getattr(torch, cfg.model.dtype)
            mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)

        def build() -> torch.nn.Module:
            m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            for layer in _decoder_layers(m):
                fully_shard(layer, mesh=self.mesh, **({"mp_policy": mp} if mp else {}))
            fully_shard(m, mesh=self.mesh, **({"mp_policy": mp} if mp else {}))
            # No dropout in RL updates: the proximal logprobs must be what the update then differentiates.
            m.train(False)
            return m

        self.model = build()
        mc = self.model.config
        self.tie_word_embeddings = bool(getattr(mc, "tie_word_embeddings", False))
        pad = mc.pad_token_id if mc.pad_token_id is not None else mc.eos_token_id
        self.pad_id = int(pad if isinstance(pad, int) else (pad[0] if pad else 0))
        self.ref_model: torch.nn.Module | None = None
        if cfg.algorithm.kl_coef > 0:
            self.ref_model = build()  # the initial weights, frozen: the KL anchor
            self.ref_model.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay
        )
        self._prepared: tuple[int, list[torch.Tensor]] | None = None
        # The last version sent (its buckets kept for a restarted engine's catch-up: one host copy of
        # the weights; on a GPU trainer that is GPU memory, see DESIGN.md "Failures and resume").
        self._published: tuple[int, list[torch.Tensor]] | None = None
        self._sender: Any = None
        # AsyPPO: an identical replica on every rank (same seed), with its own optimizer; not FSDP-wrapped.
        self.critics: MiniCritics | None = None
        if cfg.algorithm.loss == "asyppo":
            self.critics = MiniCritics(int(mc.vocab_size), cfg.algorithm, seed=cfg.run.seed).to(device)

    # ------------------------------------------------------------------ dispatch
    def execute(self, msg: Msg) -> Msg | None:
        if isinstance(msg, TrainStep):
            return self.train_step(msg.batch)
        if isinstance(msg, PrepareWeights):
            return self.prepare_weights(msg.version)
        if isinstance(msg, SendWeights):
            return self.send_weights(msg.version, msg.peers)
        if isinstance(msg, InitWeightSync):
            return self.init_weight_sync(msg)
        if isinstance(msg, ComputeLogprobs):
            lp = self.compute_logprobs(msg.prompt_ids, msg.response_ids, msg.temperature)
            return Logprobs(logprobs=lp) if self.rank == 0 else None
        if isinstance(msg, SaveCheckpoint):
            self.save_checkpoint(msg.path)
            return Ok(info=msg.path)
        if isinstance(msg, SaveModel):
            self.save_model(msg.path, msg.replace)
            return Ok(info=msg.path) if self.rank == 0 else None
        if isinstance(msg, Ping):
            return Pong(version=self.version)
        if isinstance(msg, Shutdown):
            return Ok(info="shutdown")
        raise ValueError(f"trainer: no handler for {type(msg).__name__}")

    # ------------------------------------------------------------------ forward
    def forward_logprobs(self, model: torch.nn.Module, b: PaddedBatch, entropy_grad: bool = False,
                         temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [B, T] of ``b``'s targets under ``model`` (and entropies), at the sampling temperature.

        The one recomputation behind the current, proximal and reference logprobs and ComputeLogprobs:
        scored under softmax(logits / T) with T = ``rollout.temperature`` (what the engines sampled
        training rollouts at, batch.sampling_temperature) unless ``temperature`` is given, so a ratio to
        the engines' behaviour logprobs compares one distribution. An FSDP forward: every rank calls it.
        """
        t = self.temperature if temperature is None else temperature
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)
        return token_logprobs(out.logits[:, :-1], b.targets, entropy_grad=entropy_grad, temperature=t)

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
            dist.all_reduce(gamma)  # each row is non-zero on exactly one rank
        return gamma.cpu()

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

    # ------------------------------------------------------------------ train
    def train_step(self, tb: TrainBatch) -> TrainResult | None:
        """One training step (module docstring). Metrics beyond compute_policy_loss's: advantage/* over
        the response tokens of the advantages the loss used (GRPO or critic, after credit scaling);
        critic/* (asyppo: value_mean, sigma_mean, adv_masked_frac, ent_masked_frac, loss); credit/*
        (credit != none: amplified_frac = share of response tokens with gamma > 1, gamma_mean)."""
        t0 = time.perf_counter()
        alg = self.cfg.algorithm
        full = pad_batch(tb.samples, self.pad_id)
        tied = tied_groups(full.rewards, full.groups)
        if alg.filter_ties:
            full = dataclasses.replace(full, loss_mask=full.loss_mask * (~tied).unsqueeze(-1))
        extra: dict[str, float] = {}  # critic and credit metrics: computed on the whole batch, same on every rank
        ent_mask: torch.Tensor | None = None  # AsyPPO's I^H [B, T]
        returns: torch.Tensor | None = None  # AsyPPO's critic regression targets [B, T]
        if self.critics is not None:
            dev = full.to(self.device)
            targets = self.critics.advantages_and_masks(dev.input_ids, dev.attention_mask, dev.loss_mask, dev.rewards)
            adv_tok, ent_mask, returns = targets.advantages.cpu(), targets.entropy_mask.cpu(), targets.returns
            extra.update(targets.metrics)
        else:
            adv_tok = token_advantages(grpo_advantages(full.rewards, full.groups, scale_std=alg.scale_std),
                                       full.loss_mask)
        if alg.credit != "none":
            gamma = self._credit(full, adv_tok)
            adv_tok = adv_tok * gamma
            resp = full.loss_mask > 0
            n_resp = max(int(resp.sum()), 1)
            extra["credit/amplified_frac"] = float(((gamma > 1) & resp).sum()) / n_resp
            extra["credit/gamma_mean"] = float(gamma[resp].sum()) / n_resp
        full = dataclasses.replace(full, advantages=adv_tok)
        current = tb.step
        plan = plan_micro_batches(full.size, self.world, self.rank, self.cfg.trainer.mini_batches,
                                  self.cfg.trainer.micro_batch)
        lr = warmup_lr(self.cfg.trainer.lr, self.cfg.trainer.warmup_steps, current)
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # a function of the step, not scheduler state, so a resumed run continues it
        entropy_grad = alg.entropy_coef > 0

        # Proximal (and reference) logprobs: the weights at the start of the step, no gradient. With one
        # mini-batch every forward below still sees those weights, so its own detached logp serves.
        prox: dict[tuple[int, int], torch.Tensor] = {}
        ref: dict[tuple[int, int], torch.Tensor] = {}
        if len(plan) > 1 or self.ref_model is not None:
            with torch.no_grad():
                for i, (mini, micros) in enumerate(plan):
                    for k, idx in enumerate(micros):
                        b = self._micro(full, mini, idx).to(self.device)
                        if len(plan) > 1:
                            prox[i, k] = self.forward_logprobs(self.model, b, False)[0]
                        if self.ref_model is not None:
                            ref[i, k] = self.forward_logprobs(self.ref_model, b, False)[0]

        sums: dict[str, float] = {}  # loss/*: summed over micro-batches and ranks (each carries norm / R)
        weighted: dict[str, float] = {}  # token-weighted means
        maxes: dict[str, float] = {}
        tokens = 0.0
        grad_norms: list[float] = []
        mismatch = Mismatch()
        params = [p for p in self.model.parameters() if p.requires_grad]
        for i, (mini, micros) in enumerate(plan):
            # FSDP2 averages gradients over ranks, so each rank divides by norm / R: the sum is the batch mean.
            norm = self._norm(full, mini) / self.world
            for k, idx in enumerate(micros):
                b = self._micro(full, mini, idx).to(self.device)
                em = self._rows(ent_mask, mini, idx, b.loss_mask.shape[1])
                logp, entropy = self.forward_logprobs(self.model, b, entropy_grad)
                prox_logp = prox[i, k] if prox else logp.detach()  # the weights at the start of the step
                mismatch.add(prox_logp, b.behav_logp, b.loss_mask, b.versions, current)
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
                loss.backward()
                n_tok = float(b.loss_mask.sum())
                tokens += n_tok
                for key, v in met.items():
                    if key.startswith("loss/"):
                        sums[key] = sums.get(key, 0.0) + v / len(plan)
                    elif key.endswith("/max"):
                        maxes[key] = max(maxes.get(key, -math.inf), v) if n_tok else maxes.get(key, -math.inf)
                    else:
                        weighted[key] = weighted.get(key, 0.0) + v * n_tok
            grad_norms.append(self._clip(params))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        metrics = self._reduce(sums, weighted, maxes, tokens)
        metrics.update(mismatch.reduce(self.device, self.world))
        if self.critics is not None and returns is not None:
            # after the policy step, as AsyPPO orders it; every rank updates its replica identically
            dev = full.to(self.device)
            extra.update(self.critics.update(dev.input_ids, dev.attention_mask, dev.loss_mask, returns, dev.groups))
        self.version = current + 1
        if self.rank != 0:
            return None
        m = full.loss_mask > 0
        used = full.advantages[m].to(torch.float64)  # what the loss saw: GRPO or critic, x gamma
        metrics.update(extra)
        metrics.update({
            "loss": metrics.get("loss/total", 0.0),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "reward/mean": float(full.rewards.mean()),
            "reward/std": float(full.rewards.std(correction=0)),
            "advantage/mean": float(used.mean()) if used.numel() else 0.0,
            "advantage/std": float(used.std(correction=0)) if used.numel() else 0.0,
            "advantage/min": float(used.min()) if used.numel() else 0.0,
            "advantage/max": float(used.max()) if used.numel() else 0.0,
            "samples": float(full.size),
            "tokens": float(m.sum()),
            "groups": float(count_groups(full.groups)),
            "groups/tied": float(count_groups(full.groups, tied)),
            "groups/filtered": float(count_groups(full.groups, tied)) if alg.filter_ties else 0.0,
            "optimizer_steps": float(len(plan)),
            "lr": lr,
            "step_time_s": time.perf_counter() - t0,
        })
        return TrainResult(step=tb.step, metrics=metrics)

    def _clip(self, params: list[torch.nn.Parameter]) -> float:
        """Clip to ``trainer.grad_clip`` (0: only measure); the global norm over every rank's shard."""
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        if hasattr(total, "full_tensor"):  # a DTensor: the norm of the sharded gradients, made whole
            total = total.full_tensor()
        if self.cfg.trainer.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.trainer.grad_clip, total)
        return float(total)

    def _reduce(self, sums: dict[str, float], weighted: dict[str, float], maxes: dict[str, float],
                tokens: float) -> dict[str, float]:
        """Combine per-rank metrics: loss sums / R, token-weighted means, maxima. Keys match on every
        rank because every rank ran the same loss with the same optional inputs."""
        ks, kw, km = sorted(sums), sorted(weighted), sorted(maxes)
        flat = torch.tensor([sums[k] for k in ks] + [weighted[k] for k in kw] + [tokens], dtype=torch.float64)
        crc = float(zlib.crc32(" ".join(ks + kw + km).encode()))
        mx = torch.tensor([maxes[k] for k in km] + [crc, -crc], dtype=torch.float64)
        flat, mx = flat.to(self.device), mx.to(self.device)
        dist.all_reduce(flat)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        if float(mx[-1]) != -float(mx[-2]):  # max(crc) != min(crc): seen identically on every rank
            raise RuntimeError("trainer ranks returned different metric keys; the loss must not branch on data")
        flat, mx = flat.cpu(), mx.cpu()
        out = {k: float(flat[j]) / self.world for j, k in enumerate(ks)}
        total_tok = float(flat[-1])
        out.update({k: float(flat[len(ks) + j]) / max(total_tok, 1.0) for j, k in enumerate(kw)})
        out.update({k: float(mx[j]) if math.isfinite(float(mx[j])) else 0.0 for j, k in enumerate(km)})
        return out

    # ------------------------------------------------------------------ logprobs
    def compute_logprobs(self, prompt_ids: list[int], response_ids: list[int],
                         temperature: float | None = None) -> list[float]:
        """Logprob of each response token given the prompt, current weights (every rank forwards), at
        ``temperature`` (None: rollout.temperature), as ``forward_logprobs`` scores it in a train step."""
        r = len(response_ids)
        sample = TrainSample(prompt_ids=prompt_ids, response_ids=response_ids, loss_mask=[1] * r,
                             behav_logp=[0.0] * r, versions=[0] * r, reward=0.0, group=0)
        b = pad_batch([sample], self.pad_id).to(self.device)
        with torch.no_grad():
            logp, _ = self.forward_logprobs(self.model, b, False, temperature)
        p = len(prompt_ids)
        return [float(x) for x in logp[0, p - 1 : p - 1 + r].cpu()]

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank must call this; rank 0 gets the full CPU state dict, the others an empty one."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def prepare_weights(self, version: int) -> WeightManifest | None:
        sd = self.full_state_dict()
        if self.rank != 0:
            return None
        from flashrl.weightsync import build_manifest

        self._prepared = None  # free the previous version's buckets before building new ones
        manifest, buckets = build_manifest(sd, version, self.cfg.weight_sync.bucket_mb,
                                           tie_word_embeddings=self.tie_word_embeddings)
        self._prepared = (version, buckets)
        return manifest

    def send_weights(self, version: int, peers: list[str] | None = None) -> Ok:
        """Send ``version`` to ``peers`` (None: every joined engine): the version just prepared
        (it then becomes the published one) or the published one again (a restarted engine catching up)."""
        if self._sender is None:
            raise RuntimeError("SendWeights before InitWeightSync: initialize the weight-sync group first")
        if self._prepared is not None and self._prepared[0] == version:
            buckets = self._prepared[1]
            self._published, self._prepared = self._prepared, None
        elif self._published is not None and self._published[0] == version:
            buckets = self._published[1]
        else:
            have = [v[0] for v in (self._prepared, self._published) if v is not None]
            raise RuntimeError(f"SendWeights({version}): prepared/published versions are {have}; "
                               f"send PrepareWeights({version}) first")
        seconds, failed = self._sender.send(buckets, peers)
        info = f"sent version {version} in {seconds:.3f}s"
        if failed:
            info += "; failed: " + "; ".join(f"{p}: {e}" for p, e in sorted(failed.items()))
        return Ok(info=info)

    def init_weight_sync(self, msg: InitWeightSync) -> Ok:
        """Join one engine's group (``msg.peer``); may run beside a training step (rank 0's sync thread)."""
        from flashrl.trainer.weights import WeightSender

        if msg.world_size != 2:
            raise ValueError(f"weight sync: one group of two per engine (trainer rank 0 + the engine); got world_size "
                             f"{msg.world_size}")
        if self._sender is None:
            self._sender = WeightSender()
        self._sender.join(msg.peer or "engine", msg.master_addr, msg.master_port, msg.backend, msg.timeout_s)
        return Ok(info=f"weight sync: {msg.peer or 'engine'} joined ({msg.backend})")

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, path: str, replace: bool = False) -> None:
        """The current policy as a Hugging Face folder at ``path`` (every rank gathers; rank 0 writes it,
        atomically, in model.dtype, with the run model's config, tokenizer and generation config)."""
        sd = self.full_state_dict()
        err: Exception | None = None
        if self.rank == 0:
            from flashrl.trainer.hf import save_hf_folder

            try:
                save_hf_folder(sd, self.model_path, path, dtype=self.cfg.model.dtype, replace=replace)
            except Exception as e:  # raised after the barrier: the other ranks must not wait on rank 0
                err = e
        dist.barrier()
        if err is not None:
            raise err

    def save_checkpoint(self, path: str) -> None:
        """DCP save of model + optimizer (+ critics, torch RNG) into ``path``, atomically: write ``path.tmp``, fsync, rename.

        ``path`` must be on a file system every rank sees. An existing ``path`` is refused (checkpoints
        are never overwritten in place); a leftover ``path.tmp`` from a crash is removed first.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        final, tmp = Path(path), Path(path + ".tmp")
        err = ""
        if self.rank == 0:
            if final.exists():
                err = f"checkpoint {final} already exists; choose a new path or delete it"
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.parent.mkdir(parents=True, exist_ok=True)
        if self._agree_error(err):
            raise FileExistsError(err or f"checkpoint {final} refused by rank 0")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        # torch's RNG (replicated: one copy); nothing in a step samples today, but a dropout or a sampled
        # credit would, and a resumed run must then draw what the uninterrupted one would have
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "rng": torch.get_rng_state()}
        if self.critics is not None:
            # replicated plain tensors: DCP writes one copy
            state["critics"], state["critics_optim"] = get_state_dict(self.critics, self.critics.optimizer)
        dcp.save(state, checkpoint_id=str(tmp))
        if self.rank == 0:
            meta = {"version": self.version, "world_size": self.world, "critics": self.critics is not None, "rng": True}
            (tmp / CHECKPOINT_META).write_text(json.dumps(meta))
            for f in tmp.rglob("*"):
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(final.parent)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, critics (asyppo) and version from a ``save_checkpoint`` folder (any
        world size). Critics missing from the checkpoint (it was not an asyppo run) start fresh."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        meta = json.loads((Path(path) / CHECKPOINT_META).read_text())
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if meta.get("rng"):
            state["rng"] = torch.get_rng_state()
        critics = self.critics is not None and bool(meta.get("critics", False))
        if self.critics is not None:
            if critics:
                state["critics"], state["critics_optim"] = get_state_dict(self.critics, self.critics.optimizer)
            else:
                log.warning("checkpoint %s holds no critics (not an asyppo run): the critics start fresh", path)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if critics and self.critics is not None:
            set_state_dict(self.critics, self.critics.optimizer, model_state_dict=state["critics"],
                           optim_state_dict=state["critics_optim"])
        if "rng" in state:
            torch.set_rng_state(state["rng"])
        self.version = int(meta["version"])

    def _agree_error(self, err: str) -> bool:
        """Broadcast whether rank 0 found an error, so every rank skips the collectives together."""
        flag = torch.tensor([1 if err else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())


class Mismatch:
    """Train/inference mismatch of one step: the engines' behaviour logprobs against the trainer's own.

    Over the step's on-policy response tokens (sampled by the weights the step starts from: version ==
    step), compared with the trainer's first-pass (proximal) logprobs of the same tokens before the
    update. ``mismatch/kl``: mean k3 estimate of KL(engine || trainer), exp(d) - 1 - d with d = trainer -
    engine logprob (tokens were drawn from the engine); ``mismatch/max_abs``: largest |d|;
    ``mismatch/tokens``: how many tokens were compared (no keys when none: a step of only stale samples).
    Near 0 when engines and trainer hold the same weights and score the same distribution; a weight
    that did not sync, a wrong weight name or a different temperature shows up here at once. With
    rollout.top_p < 1 it also holds the mass top-p cut off (engine logprobs are renormalized).
    """

    def __init__(self) -> None:
        self.kl_sum = 0.0
        self.tokens = 0
        self.max_abs = 0.0

    def add(self, trainer_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, versions: torch.Tensor,
            version: int) -> None:
        with torch.no_grad():
            on = (mask > 0) & (versions == version)
            n = int(on.sum())
            if n == 0:
                return
            d = (trainer_logp.detach() - behav_logp)[on].to(torch.float64).clamp(-30.0, 30.0)
            self.kl_sum += float((torch.expm1(d) - d).sum())
            self.tokens += n
            self.max_abs = max(self.max_abs, float(d.abs().max()))

    def reduce(self, device: torch.device, world: int) -> dict[str, float]:
        """Sums and max over the ranks (every rank calls it); the metrics, identical on every rank."""
        kl_sum, tokens, max_abs = self.kl_sum, float(self.tokens), self.max_abs
        if world > 1:
            flat = torch.tensor([kl_sum, tokens], dtype=torch.float64, device=device)
            mx = torch.tensor([max_abs], dtype=torch.float64, device=device)
            dist.all_reduce(flat)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            kl_sum, tokens, max_abs = float(flat[0]), float(flat[1]), float(mx[0])
        if tokens == 0:
            return {}
        return {"mismatch/kl": kl_sum / tokens, "mismatch/max_abs": max_abs, "mismatch/tokens": tokens}


# ---------------------------------------------------------------------- request fan-out
class Fanout:
    """Rank 0 sends each request to every rank as msgspec bytes in a uint8 tensor (never pickle)."""

    def __init__(self, device: torch.device, stop: list[bool]) -> None:
        self.device = device
        self._stop = stop  # set by the SIGTERM handler; checked while polling

    def send(self, msg: Msg) -> None:
        payload = protocol.encode(msg)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=self.device), 0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device), 0)

    def recv(self) -> Msg | None:
        """The next request, or None when SIGTERM arrived while waiting."""
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        work = dist.broadcast(n, 0, async_op=True)
        delay = 0.001
        while not work.is_completed():
            if self._stop[0]:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)  # idle ranks wake at most 20 times a second
        work.wait()
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, 0)
        return protocol.TRAINER_REQUESTS.decode(bytes(buf.cpu().numpy()))


def follower_loop(trainer: Trainer, fanout: Fanout) -> None:
    """Ranks 1..R-1: run every request rank 0 broadcasts until Shutdown (or SIGTERM)."""
    while True:
        msg = fanout.recv()
        if msg is None:
            log.info("SIGTERM: leaving")
            return
        try:
            trainer.execute(msg)
        except Exception:
            # Rank 0 hit the same deterministic error (same input) and answers it; keep in step.
            log.exception("%s failed", type(msg).__name__)
        if isinstance(msg, Shutdown):
            return


async def leader_loop(trainer: Trainer, fanout: Fanout, address: str) -> None:
    """Rank 0: serve the controller; fan each request out and run it on the single compute thread."""
    from flashrl.transport import RpcServer

    loop = asyncio.get_running_loop()
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")
    joins = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weight-sync-join")
    lock = asyncio.Lock()
    stop = asyncio.Event()
    last_busy = [loop.time()]
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def run(msg: Msg) -> Msg | None:
        if not isinstance(msg, _RANK0_ONLY):
            fanout.send(msg)
        return trainer.execute(msg)

    async def handle(msg: Msg) -> Msg | None:
        if isinstance(msg, Ping):
            return Pong(version=trainer.version)
        if stop.is_set():
            return Error(message="trainer is shutting down", kind="shutdown")
        if isinstance(msg, InitWeightSync):
            # A (re)started engine joins its own group while training goes on: not on the compute thread.
            return await loop.run_in_executor(joins, trainer.init_weight_sync, msg)
        async with lock:
            try:
                return await loop.run_in_executor(compute, run, msg)
            finally:
                last_busy[0] = loop.time()
                if isinstance(msg, Shutdown):
                    stop.set()

    async def keepalive() -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_S / 4)
            if not lock.locked() and loop.time() - last_busy[0] >= KEEPALIVE_S and trainer.world > 1:
                async with lock:
                    await loop.run_in_executor(compute, fanout.send, Ping())
                    last_busy[0] = loop.time()

    from flashrl.cluster.keys import CurveKeys

    keys = CurveKeys.from_env()  # set by the launcher when sockets are off loopback
    server = RpcServer(address, protocol.TRAINER_REQUESTS, handle, name=f"trainer-rank0@{address}",
                       curve=keys.server() if keys is not None else None)
    tasks = [loop.create_task(server.serve(), name="trainer-rpc"), loop.create_task(keepalive(), name="keepalive")]
    log.info("rank 0 serving %s (world %d)", address, trainer.world)
    await stop.wait()
    await asyncio.sleep(0.2)  # let the last reply (Shutdown's Ok) leave the socket before it closes
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    busy = lock.locked()
    compute.shutdown(wait=False, cancel_futures=True)
    joins.shutdown(wait=False, cancel_futures=True)
    if busy:
        # SIGTERM in the middle of a request: the compute thread may sit in a collective whose peers
        # are gone; waiting for it could take the whole process-group timeout.
        log.warning("SIGTERM during a request: exiting without waiting for it")
        logging.shutdown()
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashrl.trainer.worker", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="resolved config TOML (runs/<name>/config.toml)")
    ap.add_argument("--address", required=True, help="rank 0's ZeroMQ address, e.g. tcp://127.0.0.1:5555")
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--resume", default=None, help="checkpoint folder written by SaveCheckpoint")
    args = ap.parse_args(argv)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            print(f"trainer worker: environment variable {var} is not set; launch with torchrun or "
                  "flashrl.trainer.client.TrainerGroup", file=sys.stderr)
            return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    child_init(f"trainer rank {rank}")  # dies with the controller (a no-op under torchrun)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg = load(args.config)
    from flashrl.logging_setup import FORMAT

    logging.basicConfig(stream=sys.stderr, level=cfg.run.log_level, format=FORMAT.format(process=f"trainer{rank}"))
    stop = [False]
    if rank != 0:
        def on_term(signum: int, frame: object) -> None:
            stop[0] = True

        signal.signal(signal.SIGTERM, on_term)
    torch.set_num_threads(cfg.trainer.threads)
    backend = resolve_backend(cfg.trainer.backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    # The store listens on MASTER_ADDR only (loopback for the local launcher), not on every interface.
    init_default_group(backend, rank, world, datetime.timedelta(minutes=30))
    try:
        trainer = Trainer(cfg, args.model, device)
        if args.resume:
            trainer.load_checkpoint(args.resume)
        log.info("rank %d/%d ready: backend %s, model %s, version %d", rank, world, backend, args.model, trainer.version)
        fanout = Fanout(device, stop)
        if rank == 0:
            asyncio.run(leader_loop(trainer, fanout, args.address))
        else:
            follower_loop(trainer, fanout)
    finally:
        if not stop[0]:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    log.info("rank %d exiting", rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())

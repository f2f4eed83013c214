"""TrainBatch (wire) -> padded tensors the trainer forwards, with every per-token field aligned to logits.

Layout of one sample (P prompt tokens, R response tokens), right-padded to the batch length L::

    input_ids       p0 p1 p2 | r0 r1 r2 r3 | pad pad          positions 0 .. L-1
    logits position  0  1  2    3  4  5  6    7               logits[j] predicts input_ids[j + 1]
    targets         p1 p2 r0   r1 r2 r3 pad  pad              = input_ids[:, 1:]   (length L - 1)
    loss_mask        0  0 m0   m1 m2 m3  0    0               m_k = sample.loss_mask[k]

So response token k sits at input position P + k and is predicted by logits position P + k - 1; every
aligned tensor (targets, loss_mask, behav_logp, versions, top_ids, top_logp, teacher_logp, routes) has length L - 1 and puts token k's value at
index P + k - 1. Right padding keeps the positions of real tokens 0 .. n-1 (what the engine used), so no
position_ids are needed. A sample needs at least one prompt token (nothing predicts position 0).

Pure data: no process group, no model. ``PaddedBatch.select`` cuts the per-rank and per-micro-batch
slices; ``pad_batch`` is the only place where the off-by-one lives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from flashrl.vision.batch import PixelCache, vision_inputs
from flashrl.wire.trajectory import Trajectory


class BatchError(ValueError):
    """A Trajectory that cannot be trained on; the message names the sample and the field."""


@dataclass(frozen=True)
class PaddedBatch:
    """B samples padded to L tokens. Aligned tensors have length T = L - 1 (see the module docstring)."""

    input_ids: torch.Tensor  # [B, L] long, pad_id after each sequence
    attention_mask: torch.Tensor  # [B, L] long, 1 on real tokens
    targets: torch.Tensor  # [B, T] long, input_ids[:, 1:]
    loss_mask: torch.Tensor  # [B, T] float, 1 where a policy-generated response token is predicted
    behav_logp: torch.Tensor  # [B, T] float, engine logprob of that token (0 elsewhere)
    versions: torch.Tensor  # [B, T] long, policy version that sampled that token (-1 elsewhere)
    advantages: torch.Tensor  # [B, T] float, 0 until the trainer fills it (advantages.py)
    rewards: torch.Tensor  # [B] float
    groups: torch.Tensor  # [B] long, GRPO group id
    prompt_lens: torch.Tensor  # [B] long
    # engine.top_logprobs = k: the engine's k most likely token ids and their logprobs at each generated token
    # (-1 and 0.0 elsewhere); k = 0 (the default: [B, T, 0]) when no sample carries them
    top_ids: torch.Tensor  # [B, T, k] long
    top_logp: torch.Tensor  # [B, T, k] float
    # on-policy distillation (flashrl/distill): the teacher's log-probability of each generated token (0 elsewhere),
    # and whether the sample carries its teacher's scores at all ([B] bool; False without a teacher)
    teacher_logp: torch.Tensor  # [B, T] float
    scored: torch.Tensor  # [B] bool
    teacher_top_ids: torch.Tensor  # [B, T, k] long: the teacher's k most likely tokens (its top_k; k = 0 without)
    teacher_top_logp: torch.Tensor  # [B, T, k] float
    # a MoE policy's routes (flashrl/moe/routes.py): the packed bytes of the route each generated token was
    # sampled with (the forward over input position j = its aligned index), as values 0..255, -1 elsewhere;
    # [B, T, 0] when no sample carries routes. Decoded by flashrl/moe/replay.py, which knows the model's shape.
    routes: torch.Tensor  # [B, T, bytes per route] int16
    # a vision-language policy's images (flashrl/vision/batch.py vision_inputs, Idefics3 layout), filled by the
    # trainer after padding: [B, N, 3, H, W] and [B, N, H, W] (N = most images of a row); [B, 0] when none
    pixel_values: torch.Tensor
    pixel_attention_mask: torch.Tensor

    def vision_kwargs(self) -> dict[str, torch.Tensor]:
        """The model forward's image arguments; {} for a text-only batch."""
        if self.pixel_values.dim() <= 2:
            return {}
        return {"pixel_values": self.pixel_values, "pixel_attention_mask": self.pixel_attention_mask}

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: torch.Tensor | Sequence[int]) -> PaddedBatch:
        """The samples at ``index`` (order kept), trimmed to their own longest sequence."""
        idx = torch.as_tensor(index, dtype=torch.long)
        picked = {f.name: getattr(self, f.name)[idx] for f in fields(self)}
        length = int(picked["attention_mask"].sum(-1).max()) if len(idx) else 1
        length = max(length, 2)  # keep T >= 1 so shapes stay valid
        for name in ("input_ids", "attention_mask"):
            picked[name] = picked[name][:, :length]
        for name in ("targets", "loss_mask", "behav_logp", "versions", "advantages", "top_ids", "top_logp",
                     "teacher_logp", "teacher_top_ids", "teacher_top_logp", "routes"):
            picked[name] = picked[name][:, : length - 1]
        return PaddedBatch(**picked)

    def to(self, device: torch.device | str) -> PaddedBatch:
        return PaddedBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def _check(i: int, s: Trajectory) -> None:
    where = f"sample {i} ({s.sample_id or 'no id'})"
    if not s.prompt_ids:
        raise BatchError(f"{where}: prompt_ids is empty; the trainer needs at least one prompt token "
                         "(nothing predicts position 0): prepend a BOS token")
    r = len(s.response_ids)
    for name in ("loss_mask", "behav_logp", "versions", "top_logprobs", "teacher_logp", "teacher_top", "routes"):
        n = len(getattr(s, name))
        if n != r and not (name in ("top_logprobs", "teacher_logp", "teacher_top", "routes") and n == 0):
            raise BatchError(f"{where}: {name} has {n} entries but response_ids has {r}; "
                             "the engine reply and the trajectory are out of step")


def pad_batch(samples: Sequence[Trajectory], pad_id: int) -> PaddedBatch:
    """Right-pad ``samples`` into a PaddedBatch (aligned as in the module docstring)."""
    if not samples:
        raise BatchError("empty batch: the trainer needs at least one sample")
    for i, s in enumerate(samples):
        _check(i, s)
    b = len(samples)
    length = max(2, max(len(s.prompt_ids) + len(s.response_ids) for s in samples))
    t = length - 1
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    loss_mask = torch.zeros((b, t), dtype=torch.float32)
    behav_logp = torch.zeros((b, t), dtype=torch.float32)
    versions = torch.full((b, t), -1, dtype=torch.long)
    # Every sample's values at once (one tensor per field from flat lists, scattered by (row, column)):
    # a Python loop of small tensor writes per sample cost more than the tiny model's forward.
    tok_rows = [i for i, s in enumerate(samples) for _ in range(len(s.prompt_ids) + len(s.response_ids))]
    tok_cols = [j for s in samples for j in range(len(s.prompt_ids) + len(s.response_ids))]
    input_ids[tok_rows, tok_cols] = torch.tensor([x for s in samples for x in (*s.prompt_ids, *s.response_ids)],
                                                 dtype=torch.long)
    attention_mask[tok_rows, tok_cols] = 1
    # logits position predicting response token k is p - 1 + k
    r_rows = [i for i, s in enumerate(samples) for _ in s.response_ids]
    r_cols = [len(s.prompt_ids) - 1 + k for s in samples for k in range(len(s.response_ids))]
    if r_rows:
        m = torch.tensor([x for s in samples for x in s.loss_mask], dtype=torch.float32).clamp(0, 1)
        loss_mask[r_rows, r_cols] = m
        # Observation tokens (mask 0) carry no engine logprob/version: keep the neutral fill there.
        behav_logp[r_rows, r_cols] = torch.where(
            m > 0, torch.tensor([x for s in samples for x in s.behav_logp], dtype=torch.float32), 0.0)
        versions[r_rows, r_cols] = torch.where(
            m > 0, torch.tensor([x for s in samples for x in s.versions], dtype=torch.long), -1)
    top_ids, top_logp = _top_k(samples, b, t)
    teacher_top_ids, teacher_top_logp = _top_k(samples, b, t, "teacher_top")
    teacher_logp = torch.zeros((b, t), dtype=torch.float32)
    t_rows = [i for i, s in enumerate(samples) for _ in s.teacher_logp]
    if t_rows:
        t_cols = [len(s.prompt_ids) - 1 + k for s in samples for k in range(len(s.teacher_logp))]
        teacher_logp[t_rows, t_cols] = torch.tensor([x for s in samples for x in s.teacher_logp], dtype=torch.float32)
        teacher_logp *= loss_mask > 0
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=input_ids[:, 1:].clone(),
        loss_mask=loss_mask,
        behav_logp=behav_logp,
        versions=versions,
        advantages=torch.zeros((b, t), dtype=torch.float32),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        groups=torch.tensor([s.group for s in samples], dtype=torch.long),
        prompt_lens=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
        top_ids=top_ids,
        top_logp=top_logp,
        teacher_logp=teacher_logp,
        scored=torch.tensor([bool(s.teacher_logp) for s in samples], dtype=torch.bool),
        teacher_top_ids=teacher_top_ids,
        teacher_top_logp=teacher_top_logp,
        routes=_routes(samples, b, t),
        pixel_values=torch.zeros((b, 0)),
        pixel_attention_mask=torch.zeros((b, 0)),
    )


def with_images(b: PaddedBatch, pixels: PixelCache | None, samples: Sequence[Trajectory],
                skipped: list[int] | None = None) -> PaddedBatch:
    """``b`` with its rows' images as the model's inputs (a VLM: ``pixels`` processes each distinct image once);
    ``b`` itself when no sample has one. ``skipped`` given: a sample whose image does not load or process here
    (though its engine served it: a file gone since, another filesystem, a processor's refusal) is out of the
    loss (its loss mask zero, its images blank so every shape holds) and its index appended, instead of failing
    the step (vision/batch.py vision_inputs)."""
    if pixels is None:  # a text-only policy: nothing to look at
        return b
    rows = [[im.ref() for im in s.images] for s in samples]
    if not any(rows):
        return b
    bad: list[int] = []
    out = dataclasses.replace(b, **vision_inputs(pixels, rows, [s.sample_id for s in samples],
                                                 bad if skipped is not None else None))
    if bad:
        mask = out.loss_mask.clone()
        mask[bad] = 0
        out = dataclasses.replace(out, loss_mask=mask)
        skipped.extend(bad)  # type: ignore[union-attr]
    return out


def _top_k(samples: Sequence[Trajectory], b: int, t: int, field: str = "top_logprobs") -> tuple[torch.Tensor, torch.Tensor]:
    """``top_logprobs`` (or ``field``: teacher_top) aligned like behav_logp: [B, T, k] token ids (-1 where none) and
    logprobs (0.0), k the longest list in the batch (the engines' engine.top_logprobs, a teacher's top_k; 0 when no
    sample carries any)."""
    k = max((len(top) for s in samples for top in getattr(s, field)), default=0)
    ids = torch.full((b, t, k), -1, dtype=torch.long)
    logp = torch.zeros((b, t, k), dtype=torch.float32)
    at = [(i, len(s.prompt_ids) - 1 + j, r, tok, lp) for i, s in enumerate(samples)
          for j, top in enumerate(getattr(s, field)) for r, (tok, lp) in enumerate(top)]
    if at:  # one scatter per tensor, as pad_batch does
        rows, cols, ranks, toks, lps = zip(*at)
        ids[rows, cols, ranks] = torch.tensor(toks, dtype=torch.long)
        logp[rows, cols, ranks] = torch.tensor(lps, dtype=torch.float32)
    return ids, logp


def _routes(samples: Sequence[Trajectory], b: int, t: int) -> torch.Tensor:
    """``routes`` aligned like behav_logp: [B, T, W] int16, the bytes of each token's packed route (-1 where
    none: observation tokens, samples without routes), W the longest route in the batch (0 when none)."""
    w = max((len(r) for s in samples for r in s.routes), default=0)
    out = torch.full((b, t, w), -1, dtype=torch.int16)
    if not w:
        return out
    at = [(i, len(s.prompt_ids) - 1 + j) for i, s in enumerate(samples) for j, r in enumerate(s.routes) if len(r) == w]
    if at:
        rows, cols = zip(*at)
        blob = b"".join(r for s in samples for r in s.routes if len(r) == w)
        out[list(rows), list(cols)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(-1, w).to(torch.int16)
    return out


# vLLM's sampler (vllm/v1/sample/sampler.py, sampling_params.py): a temperature below 1e-5 is greedy and
# its logprobs come from the untempered logits; a positive one below 1e-2 is raised to 1e-2.
_GREEDY_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2


def sampling_temperature(temperature: float) -> float:
    """What the engine divides the logits by for a request sampled at ``temperature`` (greedy: 1).

    The engines return ``processed_logprobs``: log-softmax of logits / T after top-k/top-p. The trainer
    scores the same tokens with ``token_logprobs(..., temperature=T)`` so that the two agree; this is
    the one place the two sides' temperature rule is written down.
    """
    if temperature < _GREEDY_EPS:
        return 1.0
    return max(float(temperature), _MIN_TEMPERATURE)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool = False,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target under softmax(``logits`` / T) [B, T, V], and that distribution's entropy.

    T is ``sampling_temperature(temperature)``: the distribution the engine sampled from, so behaviour,
    proximal and current logprobs of one token are comparable (their ratios are importance weights).
    Not applied here: top-p/top-k truncation. The engine's logprob of a sampled token is renormalized
    over the kept tokens, so on-policy pi_trainer / pi_engine = the kept probability mass (<= 1, exactly 1
    when rollout.top_p = 1 and no top-k); importance weights then carry that factor.

    Computed in float32 whatever the logits dtype (bf16 log-softmax loses the small differences the
    ratio terms need). The entropy carries a gradient only with ``entropy_grad`` (an entropy bonus):
    otherwise it is a metric and keeping its [B, T, V] graph would only cost memory.
    """
    t = sampling_temperature(temperature)
    scaled = logits.float() if t == 1.0 else logits.float() / t
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


# --------------------------------------------------------------------------- shared prompt prefixes
@dataclass(frozen=True)
class PrefixSplit:
    """A batch cut into each distinct prompt once and every sample's continuation (GRPO's group layout).

    A group's samples share their prompt, so its tokens go through the model once (``prefix``: the G
    distinct prompts, right-padded) and each sample forwards only what follows (``cont``: B
    continuations, right-padded) against its prompt's keys and values::

        prefix_ids [G, P]     p0 p1 p2 pad                 (one row per distinct prompt)
        cont_ids   [B, R]     r0 r1 r2 r3                  (row i continues prefix row_prefix[i])
        logits predicting r0: the prefix's last real position; r1..: the continuation's positions 0..R-2

    The continuation attends to keys [prefix P | continuation R] under ``cont_attention`` [B, P + R]
    (the prefix's padding masked out) at positions ``cont_positions`` = its prompt length + 0, 1, ...:
    the same keys, queries and positions as the padded batch, so the logprobs are the same up to float
    rounding (tests/unit/test_batch.py) while the model sees sum(P_g) + sum(R_i) tokens instead of B x L.
    """

    prefix_ids: torch.Tensor  # [G, P] long
    prefix_attention: torch.Tensor  # [G, P] long
    prefix_last: torch.Tensor  # [G] long: index of each prompt's last real token
    row_prefix: torch.Tensor  # [B] long: the prefix row of each sample
    cont_ids: torch.Tensor  # [B, R] long (pad after each continuation)
    cont_attention: torch.Tensor  # [B, P + R] long
    cont_positions: torch.Tensor  # [B, R] long
    cols: torch.Tensor  # [B, R] long: the aligned column (0 .. T-1 + R) of continuation token k
    valid: torch.Tensor  # [B, R] bool: k < the sample's continuation length

    def to(self, device: torch.device | str) -> PrefixSplit:
        return PrefixSplit(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def split_prefixes(b: PaddedBatch, pad_id: int, min_share: float = 1.5) -> PrefixSplit | None:
    """``b`` as a PrefixSplit, or None when sharing would not pay (fewer than ``min_share`` samples
    per distinct prompt on average) or the batch has samples of one group with different prompts."""
    n = b.size
    if n < 2:
        return None
    groups, first = torch.unique(b.groups, return_inverse=True)
    g = len(groups)
    if n < min_share * g:
        return None
    # the representative (first) row of every group, and the check that the group shares its prompt
    dev = b.input_ids.device  # every index built here lives where the batch does (a GPU's batch too)
    rep = torch.full((g,), n, dtype=torch.long, device=dev).scatter_reduce(
        0, first, torch.arange(n, device=dev), reduce="amin")
    plen = b.prompt_lens
    if not torch.equal(plen, plen[rep][first]):
        return None
    p = int(plen.max())
    col = torch.arange(p, device=dev)
    in_prompt = col[None, :] < plen[:, None]  # [B, P]
    if not torch.equal(torch.where(in_prompt, b.input_ids[:, :p], -1),
                       torch.where(in_prompt, b.input_ids[rep][first][:, :p], -1)):
        return None
    total = b.attention_mask.sum(-1)  # [B] real tokens
    cont_len = total - plen
    r = max(int(cont_len.max()), 1)
    k = torch.arange(r, device=dev)
    valid = k[None, :] < cont_len[:, None]
    src = (plen[:, None] + k[None, :]).clamp(max=b.input_ids.shape[1] - 1)
    cont_ids = torch.where(valid, b.input_ids.gather(1, src), pad_id)
    prefix_attention = in_prompt[rep].long()
    return PrefixSplit(
        prefix_ids=torch.where(in_prompt[rep], b.input_ids[rep, :p], pad_id),
        prefix_attention=prefix_attention,
        prefix_last=plen[rep] - 1,
        row_prefix=first,
        cont_ids=cont_ids,
        cont_attention=torch.cat([prefix_attention[first], valid.long()], dim=1),
        cont_positions=plen[:, None] + k[None, :],
        cols=plen[:, None] - 1 + k[None, :],
        valid=valid,
    )


def to_aligned(values: torch.Tensor, split: PrefixSplit, width: int) -> torch.Tensor:
    """Continuation-token values [B, R] (token k of sample i) placed in aligned columns [B, width]
    (column prompt_len - 1 + k, as pad_batch lays out targets); 0 elsewhere. Keeps the gradient."""
    b, r = values.shape
    out = values.new_zeros((b, width + r))
    out = out.scatter(1, split.cols.to(values.device), values * split.valid.to(values.device))
    return out[:, :width]

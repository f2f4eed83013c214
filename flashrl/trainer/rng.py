"""Every rank's random state in a checkpoint, so that a resumed run draws what the uninterrupted one would.

What draws at a step: LoRA's adapter dropout (model.lora.dropout) and any dropout a user's model keeps on.
Each rank draws from its own generators, the CPU one and, on a GPU, its device's (dropout on CUDA tensors
draws from the device generator), and ranks draw different amounts (their micro-batches differ in length),
so their states part after the first step: one copy of rank 0's state would give every other rank the
wrong masks after a resume.

    rank_state(device)            -> this rank's state: the CPU generator's bytes, then the device's if CUDA
    gather(state, device)         -> [world, n] uint8, every rank's (the same on every rank: DCP writes one copy)
    restore(table, rank, device)  -> sets this rank's generators from its row of a saved table

A checkpoint of another world size has no row for some ranks: those take row ``rank % saved_world`` and
the restore says so (their draws then repeat another rank's, which only matters for exactness). A table
saved on the CPU restores the CPU generator only; the device generator keeps its seed.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

__all__ = ["FORMAT", "gather", "rank_state", "restore"]

log = logging.getLogger(__name__)

FORMAT = 2  # a checkpoint's meta "rng": 2 = this module's per-rank table; True (1) = one CPU state, replicated
_CPU_BYTES = torch.get_rng_state().numel()


def rank_state(device: torch.device) -> torch.Tensor:
    """This rank's generator states as one uint8 vector: CPU, then the device's (CUDA only)."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts)


def gather(state: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's ``state`` (one collective over the default group; same length on every rank: the same
    device kind), as a CPU [world, n] table."""
    world = dist.get_world_size()
    mine = state.to(device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    return torch.stack([r.cpu() for r in rows])


def restore(table: torch.Tensor, rank: int, device: torch.device) -> None:
    """Set this rank's generators from ``table`` (``gather``'s); see the module docstring for a table of
    another world size or device kind."""
    saved_world, n = table.shape
    world = dist.get_world_size()
    if saved_world != world and rank == 0:
        log.warning("checkpoint RNG was saved by %d ranks, resumed on %d: rank r takes saved rank r %% %d's state "
                    "(dropout masks will not repeat the uninterrupted run's)", saved_world, world, saved_world)
    state = table[rank % saved_world]
    torch.set_rng_state(state[:_CPU_BYTES].clone())
    if n > _CPU_BYTES and device.type == "cuda":
        torch.cuda.set_rng_state(state[_CPU_BYTES:].clone(), device)
    elif n == _CPU_BYTES and device.type == "cuda":
        log.warning("checkpoint RNG holds no device state (saved on the CPU): the GPU generator keeps its seed")

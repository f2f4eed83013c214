"""The weight sync's wire format and group, shared by both ends and owned by neither.

The trainer's end (trainer/weights.py: WeightSender) packs and broadcasts; the engine's end
(engine/weights.py: the vLLM worker extension) receives, verifies and loads. Neither imports the
other: both import this module.

    controller --PrepareWeights(v)--> trainer rank 0: build_manifest(state_dict, v) -> (manifest, buckets)
    controller --UpdateWeights(manifest)--> every live engine  } concurrently; the broadcasts pair them
    controller --SendWeights(v, peers)--> trainer rank 0: WeightSender.send(buckets, peers)
                                          |
      one group of two per engine (gloo on CPU, nccl on GPU; NOT the default process group):
      group rank 0 = trainer rank 0, rank 1 = the engine; a fresh rendezvous port per (re)start
                                          |
    for each bucket, in manifest order: broadcast(flat bucket, root=0) on every peer's group at once
    engine, weight_sync.load = "whole": receive every bucket -> verify each checksum -> load -> version = v
    engine, weight_sync.load = "bucket": check_manifest -> for each bucket: receive -> verify -> load it
                                         -> (every bucket verified and loaded) version = v

The wire format: tensors are grouped by dtype, in state-dict order, into flat 1-D buckets of at most
``bucket_mb`` MiB (a tensor larger than that gets a bucket of its own). ``WeightManifest`` lists, per
bucket, the tensors (name, shape, dtype) in packing order, the element count and a checksum.

The checksum (``bucket_checksum``) names its algorithm, and the receiver verifies with the one named:

- ``"xxh3:<hex>"``, XXH3-128 of the bucket's bytes (the ``xxhash`` package), for buckets in host memory
  (the CPU path, and a trainer that gathers its state dict with ``cpu_offload``): ~17 GiB/s on one core
  of a Zen 4 host, against 1.6 GiB/s for sha256, where the hash was what kept the sync from the raw
  broadcast's speed (bench/results/realsize/README.md). It catches any accidental change (a flipped bit,
  zeros, truncation, swapped regions); it is no defence against an adversary, and neither is needed
  here: the sync group is trusted.
- ``"sha256:<hex>"`` of the bucket's bytes: the host algorithm before xxh3 (still verified when a
  manifest names it, and ``checksum="sha256"`` picks it). Exact and strong; hashlib uses the CPU's SHA
  instructions and releases the GIL: 64 MiB in about 0.04 s on one core of the dev machine.
- ``"sum16:<nbytes>:<S1>:<S2>"`` for buckets on a GPU, so a bucket is never copied to the host just
  to be hashed: the bytes read as signed 16-bit words w_i, ``S1 = sum(w_i)``, ``S2 = sum((i+1) w_i)``
  (mod 2**64), computed with torch integer ops on the device. Integer sums are exact and
  order-independent, so both sides' parallel reductions agree bit for bit; it catches what a broken
  broadcast produces: changed values (S1), zeros or garbage, truncation (nbytes) and swapped or
  shifted regions (the position weights in S2). On a CPU it is ~10x slower than sha256 (0.4 s per
  64 MiB), hence the split. None is meant against an adversary: the sync group is trusted.

Tied embeddings: a Hugging Face state dict of a model with ``tie_word_embeddings`` holds both
``model.embed_tokens.weight`` and ``lm_head.weight`` (the same storage). vLLM's loader skips
``lm_head.weight`` for such models, so it is sent once, as ``model.embed_tokens.weight``.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from flashrl.wire.protocol import Bucket, TensorSpec, WeightManifest
from flashrl.wire.rendezvous import gloo_group, group_store

log = logging.getLogger(__name__)

_WORDS_PER_CHUNK = 1 << 22  # keeps (i + 1) * w_i and each chunk's sum inside int64 (2**59 at most)
_TWO64 = 1 << 64
_positions: dict[torch.device, torch.Tensor] = {}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"weight sync: dtype {dtype} is not supported; use one of {sorted(DTYPES)}")


ALGORITHMS = ("xxh3", "sha256", "sum16")  # what a manifest may name (the module docstring says when each)


def bucket_checksum(flat: torch.Tensor, algo: str = "auto") -> str:
    """Checksum of a contiguous 1-D bucket's bytes: algo "xxh3", "sha256", "sum16", or "auto" (by device:
    xxh3 in host memory, sum16 on a GPU)."""
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("bucket_checksum needs a contiguous 1-D tensor")
    if algo == "auto":
        algo = "xxh3" if flat.device.type == "cpu" else "sum16"
    if algo in ("xxh3", "sha256"):
        data = flat.detach().cpu().view(torch.uint8).numpy()
        if algo == "sha256":
            return "sha256:" + hashlib.sha256(data.data).hexdigest()
        import xxhash

        return "xxh3:" + xxhash.xxh3_128_hexdigest(data.data)
    if algo != "sum16":
        raise ValueError(f"bucket_checksum: unknown algorithm {algo!r}; use xxh3, sha256, sum16 or auto")
    if flat.element_size() < 2:
        raise ValueError(f"bucket_checksum: sum16 needs elements of >= 2 bytes, got {flat.dtype}")
    words = flat.view(torch.int16)
    pos = _positions.get(words.device)
    if pos is None:
        pos = torch.arange(1, _WORDS_PER_CHUNK + 1, dtype=torch.int64, device=words.device)
        _positions[words.device] = pos
    s1 = 0
    s2 = 0
    for start in range(0, words.numel(), _WORDS_PER_CHUNK):
        chunk = words[start : start + _WORDS_PER_CHUNK].to(torch.int64)
        c1 = int(chunk.sum())
        c2 = int((chunk * pos[: chunk.numel()]).sum())  # not torch.dot: CUDA has no integer dot
        s1 += c1
        s2 += c2 + start * c1  # shift this chunk's weights from (j + 1) to (start + j + 1)
    return f"sum16:{flat.numel() * flat.element_size()}:{s1 % _TWO64}:{s2 % _TWO64}"


def verify_checksum(flat: torch.Tensor, expected: str) -> str:
    """The checksum of ``flat`` by the algorithm ``expected`` names (compare the two for equality)."""
    algo = expected.split(":", 1)[0]
    if algo not in ALGORITHMS:
        return f"unknown-algorithm:{algo}"
    return bucket_checksum(flat, algo)


def _drop_tied(state_dict: Mapping[str, torch.Tensor], tie_word_embeddings: bool | None) -> list[str]:
    names = list(state_dict)
    if "lm_head.weight" not in state_dict or "model.embed_tokens.weight" not in state_dict:
        return names
    if tie_word_embeddings is None:
        a, b = state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"]
        tie_word_embeddings = a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
    if tie_word_embeddings:
        names.remove("lm_head.weight")
    return names


def build_manifest(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    bucket_mb: float,
    tie_word_embeddings: bool | None = None,
    checksum: str = "auto",
) -> tuple[WeightManifest, list[torch.Tensor]]:
    """Pack ``state_dict`` into flat single-dtype buckets; return the manifest and the buckets.

    ``tie_word_embeddings``: None detects it (``lm_head.weight`` sharing the embedding's storage);
    True/False says it (pass the model config's value when the state dict was copied and lost the
    sharing). ``checksum``: "auto" (xxh3 for host buckets, sum16 for GPU ones), "xxh3", "sha256" or "sum16".
    Buckets are new tensors on the device of the state dict's tensors.
    """
    if bucket_mb <= 0:
        raise ValueError(f"build_manifest: bucket_mb must be > 0, got {bucket_mb}")
    limit = max(1, int(bucket_mb * (1 << 20)))
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in _drop_tied(state_dict, tie_word_embeddings):
        t = state_dict[name]
        dtype_name(t.dtype)  # reject unsupported dtypes up front, naming the dtype
        by_dtype.setdefault(t.dtype, []).append(name)

    buckets: list[Bucket] = []
    flats: list[torch.Tensor] = []

    def flush(group: list[str], dtype: torch.dtype) -> None:
        parts = [state_dict[n].detach().reshape(-1) for n in group]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        specs = [TensorSpec(name=n, shape=list(state_dict[n].shape), dtype=dtype_name(dtype)) for n in group]
        buckets.append(Bucket(tensors=specs, numel=flat.numel(), dtype=dtype_name(dtype), checksum=bucket_checksum(flat, checksum)))
        flats.append(flat)

    for dtype, names in by_dtype.items():
        group: list[str] = []
        nbytes = 0
        for name in names:
            size = state_dict[name].numel() * state_dict[name].element_size()
            if group and nbytes + size > limit:
                flush(group, dtype)
                group, nbytes = [], 0
            group.append(name)
            nbytes += size
        if group:
            flush(group, dtype)
    return WeightManifest(version=version, buckets=buckets), flats


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) pairs of one received bucket, in manifest order; the views share ``flat``."""
    offset = 0
    for spec in bucket.tensors:
        n = 1
        for d in spec.shape:
            n *= d
        yield spec.name, flat[offset : offset + n].view(spec.shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"weight manifest: bucket holds {flat.numel()} elements but its tensors need {offset}")


def bucket_nbytes(bucket: Bucket) -> int:
    """Bytes of one bucket on the wire (0 for a dtype this build does not know; check_manifest names it)."""
    dtype = DTYPES.get(bucket.dtype)
    return 0 if dtype is None else bucket.numel * dtype.itemsize


def manifest_nbytes(manifest: WeightManifest) -> int:
    """Bytes of every bucket of ``manifest``: one full copy of the weights on the wire."""
    return sum(bucket_nbytes(b) for b in manifest.buckets)


def check_manifest(manifest: WeightManifest) -> list[str]:
    """Everything wrong with ``manifest`` that can be known before a byte arrives; [] when it is sound.

    A bucket-by-bucket load (engine/weights.py) starts writing the model with the first bucket, so what
    would make a later bucket unloadable must be found first: an unknown dtype, a tensor whose dtype is
    not its bucket's, a bucket whose element count is not the sum of its tensors' shapes (``unpack_bucket``
    would fail), an unknown checksum algorithm (no bucket could pass), a name sent twice, or no bucket at
    all. What no manifest check can see (a bucket's bytes, a name the model's loader refuses) is still
    found only when it arrives."""
    errors: list[str] = []
    if not manifest.buckets:
        errors.append("the manifest lists no bucket")
    seen: set[str] = set()
    for i, bucket in enumerate(manifest.buckets):
        if bucket.dtype not in DTYPES:
            errors.append(f"bucket {i}: unsupported dtype {bucket.dtype!r} (use one of {sorted(DTYPES)})")
        algo = bucket.checksum.split(":", 1)[0]
        if algo not in ALGORITHMS:
            errors.append(f"bucket {i}: unknown checksum algorithm {algo!r}")
        numel = 0
        for spec in bucket.tensors:
            n = 1
            for d in spec.shape:
                if d < 0:
                    errors.append(f"bucket {i}: {spec.name} has a negative dimension in {spec.shape}")
                n *= d
            numel += n
            if spec.dtype != bucket.dtype:
                errors.append(f"bucket {i}: {spec.name} is {spec.dtype} in a {bucket.dtype} bucket")
            if spec.name in seen:
                errors.append(f"bucket {i}: {spec.name} is sent twice")
            seen.add(spec.name)
        if numel != bucket.numel:
            errors.append(f"bucket {i}: holds {bucket.numel} elements but its tensors need {numel}")
    return errors


def join_group(
    master_addr: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float
) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    """Join the weight-sync group without touching the default process group (vLLM has its own).

    Returns the backend itself (a ``ProcessGroupGloo`` / ``ProcessGroupNCCL``, not a ``dist.ProcessGroup``):
    call ``group.broadcast(tensor, root)`` on it, never ``dist.broadcast(group=...)``.

    Group rank 0 (trainer rank 0) hosts the TCPStore, listening on ``master_addr:master_port`` only
    (flashrl/wire/rendezvous.py: loopback for the local launcher); the others connect to it. Every member
    must call this concurrently; it returns once all ``world_size`` joined.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"weight sync: rank {rank} is outside the group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore("flashrl-weight-sync", group_store(master_addr, master_port, rank, world_size, timeout))
    if backend == "gloo":
        return gloo_group(store, rank, world_size, timeout, master_addr)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"weight sync: backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (GPU)")


def group_device(backend: str) -> torch.device:
    """Where broadcast buffers live: host memory for gloo, the current GPU for nccl."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

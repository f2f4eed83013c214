"""Every message that crosses a process boundary.

    controller --EngineRequest-->  engine process   --EngineReply-->  controller
    controller --TrainerRequest--> trainer rank 0   --TrainerReply--> controller

Messages are msgspec structs in tagged unions (the tag is the class name), encoded with msgpack.
Nothing crosses a process boundary as pickle. A frame carries one message or a batch of them (a
msgpack array: ``encode_batch``; the transport coalesces what one event-loop tick sends to a peer). Each request carries ``rid``, a per-channel request id
the reply echoes, so one socket can multiplex many concurrent requests (see transport.py).

A frame that does not decode into the expected union is a ``ProtocolError``: the receiver logs it,
answers nothing, and treats the sender as untrusted (transport.py closes the peer).
"""

from __future__ import annotations

import typing
from typing import Literal, Union

import msgspec

from flashrl.wire.trajectory import Image, Trajectory


class Msg(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    """Base of every wire message. ``rid`` pairs a reply with its request."""

    rid: int = 0


# --------------------------------------------------------------------------- engine requests
class Generate(Msg):
    """Generate one sample. Token ids in; the controller tokenized once and never re-tokenizes."""

    request_id: str = ""
    prompt_ids: list[int] = []
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks, tests); EOS stops otherwise
    top_logprobs: int = 0  # k > 0: Generated.top_logprobs holds each token's k most likely (engine.top_logprobs)
    # A vision-language policy's prompt (flashrl/vision): one image token in prompt_ids per image, the images as
    # references (encoded PNG/JPEG bytes or a file path: the engine decodes them, off its event loop), and the
    # image expansion's special tokens, never to be sampled (an image token in a response has no pixels behind it)
    images: list[Image] = []
    banned_token_ids: list[int] = []


class Score(Msg):
    """Score a token sequence without generating: the model's log-probability of each token of ``token_ids``
    from position ``start`` on, given the tokens before it (vLLM's prompt logprobs: the untempered log-softmax,
    temperature 1). A distillation teacher's request (flashrl/distill): the policy's prompt + response, scored whole."""

    request_id: str = ""
    token_ids: list[int] = []
    start: int = 1  # the first position scored (>= 1: nothing predicts position 0)
    top_k: int = 0  # k > 0: Scored.top_logprobs holds each scored position's k most likely tokens too


class Abort(Msg):
    """Abort in-flight requests; each aborted request answers with finish_reason "abort"."""

    request_ids: list[str] = []


class Pause(Msg):
    """Pause generation. mode: "keep" (in-flight requests resume later), "abort", or "wait"."""

    mode: Literal["keep", "abort", "wait"] = "keep"


class Resume(Msg):
    pass


class InitWeightSync(Msg):
    """Join one engine's weight-sync group of two: trainer rank 0 is group rank 0, the engine rank 1.

    ``peer`` names the engine (the trainer keeps one group per peer; an engine ignores it)."""

    master_addr: str = "127.0.0.1"
    master_port: int = 0
    rank: int = 1
    world_size: int = 2
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = 120.0
    peer: str = ""


class TensorSpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    name: str
    shape: list[int]
    dtype: str


class Bucket(msgspec.Struct, forbid_unknown_fields=True):
    """Tensors sent in one flat broadcast; checksum names its algorithm (wire/weights.py bucket_checksum)."""

    tensors: list[TensorSpec]
    numel: int
    dtype: str
    checksum: str


class WeightManifest(Msg):
    """What the trainer is about to broadcast for ``version``, bucket by bucket."""

    version: int = 0
    buckets: list[Bucket] = []
    # where the trainer's preparation went, seconds (gather_s: full state dict; pack_s: buckets and
    # checksums); informational, for the step record (time/sync/*) and `flashrl bench steptime`
    timings: dict[str, float] = {}


class UpdateWeights(Msg):
    """Pause, receive the broadcast described by the manifest, verify checksums, load, resume."""

    manifest: WeightManifest = msgspec.field(default_factory=WeightManifest)


class GetLoad(Msg):
    pass


class Ping(Msg):
    pass


class Shutdown(Msg):
    pass


EngineRequest = Union[Generate, Score, Abort, Pause, Resume, InitWeightSync, UpdateWeights, GetLoad, Ping, Shutdown]


# --------------------------------------------------------------------------- engine replies
class Generated(Msg):
    """One finished (or aborted) sample. ``versions[i]`` is the policy version that sampled token i."""

    request_id: str = ""
    token_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    # Generate.top_logprobs = k > 0: per token, the k most likely (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] = []
    finish_reason: str = "stop"  # "stop" | "length" | "abort"
    engine: str = ""
    # a MoE policy's routes (flashrl/moe/routes.py): per token, its top-k experts in every MoE layer, packed
    # (uint8, or int16 past 256 experts), tokens back to back; b"" when the engine captures none
    routes: bytes = b""
    # a request with images: the prompt ids the engine served, its image tokens expanded (what the trainer
    # forwards); [] for a text-only request
    prompt_ids: list[int] = []


class Scored(Msg):
    """Score's answer: ``logprobs[j]`` is the log-probability of ``token_ids[start + j]``; ``top_logprobs[j]``
    (Score.top_k > 0) that position's k most likely (token id, logprob), most likely first."""

    request_id: str = ""
    logprobs: list[float] = []
    top_logprobs: list[list[tuple[int, float]]] = []
    engine: str = ""


class WeightsUpdated(Msg):
    version: int = 0
    ok: bool = True
    seconds: float = 0.0
    error: str = ""
    # the engine's phases, seconds: receive_s (broadcast) and verify_s (checksums), both beside generation; pause_s
    # (waiting for the engine's current step), load_s, rpc_s, resume_s. With weight_sync.load = "bucket" only the
    # first bucket is received beside generation: load_s includes receiving and verifying the others
    timings: dict[str, float] = {}
    # how busy the engine was since its previous update, fractions of the wall time: stepping (vLLM's
    # step), commands (adding requests, aborts, weight loads); {} from an engine that does not measure it
    occupancy: dict[str, float] = {}
    # the receive buffers the engine held for this sync, bytes (engine/sync_extra_bytes): one copy of the
    # weights in weight_sync.load "whole", a few buckets in "bucket"; 0 from an engine that does not measure it
    extra_bytes: int = 0
    # LoRA: vLLM refused this adapter version (AdapterRefused, below); the engine is alive and still
    # serves ``version``, its previous one
    adapter_refused: bool = False


class AdapterRefused(RuntimeError):
    """vLLM refused a LoRA adapter version: it does not fit the engine's LoRA settings (rank, target modules,
    shapes), or its folder could not be written. Defined here, once, for both ends: an engine raises it per load
    (engine/lora.py; the slot keeps the version it had, the engine lives on, and its answer carries
    ``WeightsUpdated.adapter_refused``); the controller raises it when versions keep being refused
    (controller/publisher.py), which ends the run: a restart would send the same adapter, so it is final."""

    def __init__(self, message: str, version: int | None = None, kept: int | None = None) -> None:
        super().__init__(message)
        self.version, self.kept = version, kept


class LoadReport(Msg):
    engine: str = ""
    version: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    tokens_per_s: float = 0.0
    busy_fraction: float = 0.0
    generated_tokens: int = 0


class Ok(Msg):
    """Plain acknowledgement."""

    info: str = ""


class Pong(Msg):
    version: int = 0


class Error(Msg):
    """A per-request error the sender can recover from (the process is still healthy)."""

    message: str = ""
    kind: str = "error"


EngineReply = Union[Generated, Scored, WeightsUpdated, LoadReport, Ok, Pong, Error]


# --------------------------------------------------------------------------- trainer
class TrainBatch(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    step: int
    samples: list[Trajectory]  # the record itself (wire/trajectory.py): the batch builder reads its fields


class TrainStep(Msg):
    """Train on one batch (whole groups). The trainer computes advantages itself."""

    batch: TrainBatch = msgspec.field(default_factory=lambda: TrainBatch(step=0, samples=[]))


class TrainResult(Msg):
    """``sample_iw``: per TrainBatch sample, in its order, the mean over its generated tokens of the
    behaviour importance weight pi_prox / pi_behav (the weights the step started from over the engine's
    logprob: decoupled_ppo's w before its cap); None for a sample the step skipped (trainer.skip_inert).
    Empty when the trainer does not report it."""

    step: int = 0
    metrics: dict[str, float] = {}
    sample_iw: list[float | None] = []


class PrepareWeights(Msg):
    """Gather the full state dict for ``version`` and answer with its WeightManifest."""

    version: int = 0


class SendWeights(Msg):
    """Broadcast the weights of ``version`` to ``peers`` (None: every joined engine), concurrently.

    ``version`` is the one just prepared, or the last one sent (a catch-up of a restarted engine).
    The reply is Ok; its ``info`` names the peers that failed (they never block the others)."""

    version: int = 0
    peers: list[str] | None = None


class DropWeightPeer(Msg):
    """Engine ``peer`` is dead (the controller's word): stop waiting on its weight-sync group. A send to it
    in flight ends at once for that peer (its group is set aside, never used again: a restarted engine
    joins a new one); the other peers' sends go on. Answered at once, never queued behind a command."""

    peer: str = ""


class ComputeLogprobs(Msg):
    """Log-probabilities of ``response_ids`` given ``prompt_ids`` under the trainer's weights, scored at
    ``temperature`` as the engine samples (0 = greedy: untempered); None = the run's rollout.temperature."""

    prompt_ids: list[int] = []
    response_ids: list[int] = []
    temperature: float | None = None


class Logprobs(Msg):
    logprobs: list[float] = []


class SaveCheckpoint(Msg):
    """DCP checkpoint of the trainer's state at ``path`` (appears atomically). ``background``: reply once the
    state is staged in host memory; the write goes on beside training and ``path`` appears only after a
    ``FinishCheckpoint(path)`` saw it complete (trainer/worker.py ``Trainer.save_checkpoint``, trainer/ckpt_writer.py)."""

    path: str = ""
    background: bool = False


class FinishCheckpoint(Msg):
    """Wait (at most ``timeout_s``) for the background write of ``path`` and seal it (rename into place);
    answered off the command loop (trainer/ckpt_writer.py), so training commands meanwhile are not held up."""

    path: str = ""
    timeout_s: float = 0.0


class CheckpointSaved(Msg):
    """Reply to SaveCheckpoint / FinishCheckpoint: ``wait_s`` spent waiting for an earlier write in flight
    (SaveCheckpoint), ``write_s`` the background write's whole duration (FinishCheckpoint)."""

    path: str = ""
    wait_s: float = 0.0
    write_s: float = 0.0


class SaveModel(Msg):
    """Write the current policy as a Hugging Face folder at ``path`` (flashrl/models/export.py), atomically;
    ``replace``: an existing folder there is replaced."""

    path: str = ""
    replace: bool = False


TrainerRequest = Union[TrainStep, PrepareWeights, SendWeights, InitWeightSync, ComputeLogprobs, SaveCheckpoint,
                       FinishCheckpoint, SaveModel, Ping, Shutdown, DropWeightPeer]
TrainerReply = Union[TrainResult, WeightManifest, Ok, Logprobs, Pong, Error, CheckpointSaved]


# --------------------------------------------------------------------------- node agent (SLURM launcher)
# controller's SlurmLauncher (and node 0's head) --NodeRequest--> `flashrl node` on each node --NodeReply-->
class NodeHello(Msg):
    """Who are you (also the head's heartbeat: an agent that hears nothing stops its processes)."""


class NodeInfo(Msg):
    node: int = 0  # SLURM_NODEID
    hostname: str = ""
    host: str = ""  # the address this node's sockets bind to (cluster.interface on this node)
    gpus: int = 0  # GPUs visible to the agent
    pid: int = 0


class FreePort(Msg):
    """A TCP port free now on the node's address (the caller's process binds it a moment later)."""


class PortReply(Msg):
    port: int = 0


class Spawn(Msg):
    """Start ``argv`` on the node (argv[0] "python" = the node's flashrl python) as a procs.Child."""

    key: str = ""  # the launcher's name for this start (a restart gets a new key)
    name: str = ""  # "engine engine0", "trainer rank 1"
    argv: list[str] = []
    env: dict[str, str] = {}  # extra variables, merged over the agent's environment
    gpus: list[int] = []  # indices into the node's visible GPUs -> CUDA_VISIBLE_DEVICES
    log_path: str = ""
    cwd: str = ""


class Spawned(Msg):
    pid: int = 0


class PollProcs(Msg):
    """Which of the agent's processes have exited (also a heartbeat)."""


class ProcStates(Msg):
    exited: dict[str, int] = {}  # key -> return code
    running: list[str] = []


class StopProc(Msg):
    """SIGTERM the process group, SIGKILL after ``term_s``; reply once the group is empty."""

    key: str = ""
    term_s: float = 5.0


class KillProc(Msg):
    key: str = ""


class ReapProc(Msg):
    key: str = ""
    timeout: float = 5.0


class Reaped(Msg):
    ok: bool = True  # the process group is empty
    code: int | None = None


class StopAll(Msg):
    """Stop every process this agent started (the launcher closes); the agent stays up."""

    term_s: float = 5.0


class NodeShutdown(Msg):
    """Stop every process and exit (the run is over)."""


NodeRequest = Union[NodeHello, FreePort, Spawn, PollProcs, StopProc, KillProc, ReapProc, StopAll, NodeShutdown]
NodeReply = Union[NodeInfo, PortReply, Spawned, ProcStates, Reaped, Ok, Error]


class ProtocolError(Exception):
    """A frame that is not a valid message of the expected union."""


_encoder = msgspec.msgpack.Encoder()


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def encode_batch(parts: list[bytes]) -> bytes:
    """One frame carrying several already encoded messages: a msgpack array of them (``Codec.decode_frame``).

    Each message is encoded on its own first (``encode``), so one that cannot be encoded fails its own
    request, not the batch it would have joined."""
    n = len(parts)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(parts)


class Codec:
    """Decode frames of one union type; a bad frame raises ProtocolError naming the problem.

    ``decode``: one message. ``decode_frame``: what the transport receives, one message or a batch of
    them (a msgpack array, ``encode_batch``), every item validated against the union."""

    def __init__(self, union: object, side: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        members = typing.get_args(union) or (union,)
        self._frames = msgspec.msgpack.Decoder(Union[(list[union], *members)])  # type: ignore[valid-type]
        self._side = side

    def decode(self, frame: bytes) -> Msg:
        try:
            return self._decoder.decode(frame)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ProtocolError(f"malformed {self._side} message ({len(frame)} bytes): {e}") from e

    def decode_frame(self, frame: bytes) -> list[Msg]:
        """The messages of one frame, in order; a malformed item makes the whole frame malformed."""
        try:
            out = self._frames.decode(frame)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ProtocolError(f"malformed {self._side} message ({len(frame)} bytes): {e}") from e
        return out if isinstance(out, list) else [out]


ENGINE_REQUESTS = Codec(EngineRequest, "engine request")
ENGINE_REPLIES = Codec(EngineReply, "engine reply")
TRAINER_REQUESTS = Codec(TrainerRequest, "trainer request")
TRAINER_REPLIES = Codec(TrainerReply, "trainer reply")
NODE_REQUESTS = Codec(NodeRequest, "node agent request")
NODE_REPLIES = Codec(NodeReply, "node agent reply")

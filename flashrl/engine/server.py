"""The engine process: vLLM's LLMEngine, stepped by a thread of its own (engine/inproc.py), behind a ZeroMQ RpcServer.

    controller --EngineRequest--> RpcServer (ROUTER) --one task per request--> EngineServer.handle
        Generate        -> InprocEngine.generate (token ids in, FINAL_ONLY out) -> Generated
        Score           -> InprocEngine.generate of one greedy token with prompt logprobs -> Scored (a
                           distillation teacher's log-probability of each token of a sequence; flashrl/distill)
        Abort           -> InprocEngine.abort: the aborted Generate answers finish_reason "abort"
        Pause / Resume  -> InprocEngine.pause(mode) / resume
        InitWeightSync  -> worker: join the weight-sync group (engine/weights.py)
        UpdateWeights   -> [one at a time] worker: receive, verify (beside generation: the engine
                           thread steps on) -> [between two engine steps, nothing generating] load
                           -> version label -> clear the KV cache -> WeightsUpdated
                           (weight_sync.load = "bucket": only bucket 0 beside generation; the rest is
                           received, verified and loaded one bucket at a time while nothing generates)
        GetLoad         -> LoadMeter.report (fed by a vLLM stat logger and the Generate tasks)
        Ping / Shutdown -> Pong(version) / Ok, then a clean exit (SIGTERM does the same)

Logprobs: each returned logprob is the sampled token's under the distribution it was drawn from
(vLLM ``logprobs_mode="processed_logprobs"``): log-softmax of logits / temperature, renormalized over
the tokens top-k/top-p kept; greedy (temperature 0): the plain log-softmax. The trainer recomputes
with the same temperature (trainer/batch.py ``token_logprobs``); top-p/top-k it does not apply, so
with rollout.top_p < 1 on-policy trainer/engine ratios equal the kept mass (<= 1), not 1.

Per-token policy versions come from vLLM itself: the server labels its weights with
``LLMEngine.set_weight_version(str(version))`` while nothing generates, the EngineCore attaches
that label to every step's output, and the finished output carries ``weight_versions`` spans, so a
token is stamped with the weights that actually produced it even when an update lands mid-request.

Fault injection (tests, chaos runs): ``FLASHRL_FAULT_KILL_IN_SYNC`` kills the engine mid weight sync
(see ``_inject_sync_fault``).

Failure tiers: a bad request (e.g. a prompt longer than max_model_len) answers ``Error`` for that
request only. A vLLM step that raises (the engine thread ends), or weights that failed to load after passing their checksums (a
half-written model must never be served), end this process with exit code 1: the controller sees
the peer die. The engine thread is a daemon of this process: nothing of vLLM outlives it. Logs go to stderr (the launcher redirects them to runs/<name>/logs/<engine>.log).

Entry point: ``python -m flashrl.engine.server`` with its ``EngineSpec`` as JSON in ``FLASHRL_SPEC``
(flashrl/wire/spec.py; engine/client.py sets it); a missing or malformed spec exits 2 naming the problem.
The socket is bound first, before vLLM is built: an address already taken exits EXIT_ADDRESS_IN_USE (75), which
the launchers answer with a start on a new address; requests wait in the socket until the engine serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import zmq
from msgspec import Meta

from flashrl.engine.inproc import EngineDead, InprocEngine
from flashrl.engine.load import LoadMeter, stat_logger_factory
from flashrl.engine.vllm_compat import require_vllm
from flashrl.moe.source import choose_route_source, prompt_start, start_routes, vllm_routes
from flashrl.procs import child_init, exit_now, paused_gc
from flashrl.vision.images import ImageLoadError, load_image
from flashrl.wire.protocol import (
    ENGINE_REQUESTS,
    Abort,
    Error,
    Generate,
    Generated,
    GetLoad,
    InitWeightSync,
    Msg,
    Ok,
    Pause,
    Ping,
    Pong,
    Resume,
    Score,
    Scored,
    Shutdown,
    UpdateWeights,
    WeightsUpdated,
)
from flashrl.wire.spec import read_spec_or_exit
from flashrl.wire.trajectory import Image

log = logging.getLogger("flashrl.engine")



def top_k_of(positions: list[Any], k: int) -> list[list[tuple[int, float]]]:
    """vLLM's per-position logprob dicts (token id -> Logprob, ``rank`` 1 = most likely; the sampled token is
    in it at whatever rank) -> each position's ``k`` most likely (token id, logprob), most likely first; []
    when ``k`` is 0."""
    if k <= 0:
        return []
    return [[(int(t), float(lp.logprob)) for t, lp in sorted(pos.items(), key=lambda kv: kv[1].rank)
             if lp.rank is not None and lp.rank <= k] for pos in positions]


def decode_images(refs: list[Image], request_id: str) -> list[Any]:
    """A request's image references decoded (RGB PIL images), in prompt order; ImageLoadError naming the request
    (the controller's sample id) and the file."""
    return [load_image(ref.ref(), f"request {request_id} image {k}") for k, ref in enumerate(refs)]


class EngineSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything one engine process needs: the parent passes it in ``FLASHRL_SPEC`` (flashrl.wire.spec)."""

    address: Annotated[str, Meta(description="ZeroMQ address to bind, e.g. tcp://127.0.0.1:5555")]
    model: Annotated[str, Meta(description="local Hugging Face model folder")]
    name: Annotated[str, Meta(description="engine name (logs, Generated.engine, LoadReport.engine)")] = "engine0"
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], Meta(description="weights dtype")] = "float32"
    max_model_len: Annotated[int, Meta(ge=16, description="prompt + response tokens per sequence")] = 256
    kv_cache_gib: Annotated[float, Meta(gt=0, description="CPU KV cache in GiB")] = 0.5
    max_num_seqs: Annotated[int, Meta(ge=1, description="concurrent sequences")] = 128
    device: Annotated[Literal["cpu", "cuda"], Meta(description="where vLLM runs")] = "cpu"
    threads: Annotated[int, Meta(ge=1, description="CPU threads for the model (cpu)")] = 1
    seed: Annotated[int, Meta(ge=0, description="vLLM's global seed (per-request seeds override it)")] = 0
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1, description="fraction of GPU memory (cuda)")] = 0.5
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], Meta(description="log level")] = "INFO"
    nice: Annotated[int, Meta(ge=0, le=19, description="CPU priority: Linux nice of this process and its session")] = 0
    sync_load: Annotated[Literal["whole", "bucket"], Meta(description="weight_sync.load: load a sync once every bucket verified (whole) or bucket by bucket")] = "whole"
    lora_rank: Annotated[int, Meta(ge=0, le=512, description="model.lora.rank: serve the policy as a LoRA adapter of this rank, each sync a new adapter version (0 = off: full weights)")] = 0
    lora_config: Annotated[dict[str, Any], Meta(description="the adapter's adapter_config.json (peft) when lora_rank > 0")] = {}
    routes: Annotated[bool, Meta(description="capture a MoE model's routes per generated token (flashrl/moe/capture.py)")] = False
    route_source: Annotated[Literal["auto", "vllm", "hooks"], Meta(description="[moe] capture_source: vLLM's own capture or flashrl's hooks (flashrl/moe/source.py)")] = "auto"


# --------------------------------------------------------------------------- the engine shell
EXIT_ADDRESS_IN_USE = 75  # sysexits' EX_TEMPFAIL: the address given was taken before the engine could bind it


class EngineFatal(Exception):
    """This process must exit: the vLLM engine thread died or the model holds half-loaded weights."""


class EngineServer:
    """Turns EngineRequests into InprocEngine calls. Holds no socket: ``serve`` wires it to one."""

    def __init__(self, engine: InprocEngine, name: str, meter: LoadMeter, sync_load: str = "whole",
                 adapter: Any = None) -> None:
        self.engine = engine
        # LoRA (engine/lora.py PolicyAdapter): each sync is an adapter version, loaded in place; None: full weights
        self.adapter = adapter
        self.name = name
        self.sync_load = sync_load  # weight_sync.load: "whole" or "bucket" (engine/weights.py)
        self.meter = meter
        self.version = 0
        self.fatal: asyncio.Event = asyncio.Event()
        self.fatal_reason = ""
        self.stop: asyncio.Event = asyncio.Event()
        self._update_lock = asyncio.Lock()
        # vLLM's names, looked up once: its package __getattr__ imports on every access (~3% of the
        # event loop's time when every Generate looked them up)
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._params, self._prompt, self._final_only = SamplingParams, TokensPrompt, RequestOutputKind.FINAL_ONLY
        self.vllm_routes: Any = None  # the route shape when the routes are vLLM's own (flashrl/moe/source.py)

    async def start(self) -> None:
        version = str(self.version)
        await self.engine.call(lambda llm: llm.set_weight_version(version))

    async def handle(self, msg: Msg) -> Msg | None:
        try:
            return await self._dispatch(msg)
        except EngineFatal as e:
            self._die(str(e))
            raise
        except Exception as e:
            if isinstance(e, EngineDead) or self.engine.errored:
                self._die(f"vLLM engine died: {e}")
            raise

    def _die(self, reason: str) -> None:
        if not self.fatal.is_set():
            log.critical("%s: fatal: %s; exiting", self.name, reason)
            self.fatal_reason = reason
            self.fatal.set()

    async def _dispatch(self, msg: Msg) -> Msg | None:
        if isinstance(msg, Generate):
            return await self.generate(msg)
        if isinstance(msg, Score):
            return await self.score(msg)
        if isinstance(msg, Abort):
            await self.engine.abort(list(msg.request_ids))
            return Ok()
        if isinstance(msg, Pause):
            await self.engine.pause(msg.mode)
            return Ok(info=f"paused ({msg.mode})")
        if isinstance(msg, Resume):
            await self.engine.resume()
            return Ok(info="resumed")
        if isinstance(msg, InitWeightSync):
            args = (msg.master_addr, msg.master_port, msg.rank, msg.world_size, msg.backend, msg.timeout_s)
            await self.engine.call(lambda llm: llm.collective_rpc("flashrl_init_weight_sync", args=args))
            return Ok(info=f"joined weight sync as rank {msg.rank}/{msg.world_size}")
        if isinstance(msg, UpdateWeights):
            return await self.update_weights(msg)
        if isinstance(msg, GetLoad):
            return self.meter.report(time.monotonic(), self.name, self.version)
        if isinstance(msg, Ping):
            return Pong(version=self.version)
        if isinstance(msg, Shutdown):
            # Reply first; the serve loop exits once the reply is on its way.
            asyncio.get_running_loop().call_later(0.1, self.stop.set)
            return Ok(info="shutting down")
        return Error(message=f"{self.name}: {type(msg).__name__} is not an engine request", kind="protocol")

    async def generate(self, req: Generate) -> Generated | Error:
        params = self._params(
            n=1,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),  # protocol: -1 = off; vLLM: 0 = off
            max_tokens=req.max_tokens,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            logprobs=req.top_logprobs,  # 0: the sampled token's own logprob only; k: and the k most likely
            detokenize=False,  # token ids in, token ids out
            output_kind=self._final_only,
            skip_clone=True,  # built for this one request: vLLM need not deep-copy it (3% of the engine thread)
            # a VLM's image tokens: never sampled (-100 is vLLM's strongest bias; logprobs stay the raw model's)
            logit_bias={t: -100.0 for t in req.banned_token_ids} if req.banned_token_ids else None,
            # vLLM's own route capture: the rows of the positions the sampled tokens came from (moe/source.py)
            **({"routed_experts_prompt_start": prompt_start(len(req.prompt_ids))} if self.vllm_routes else {}),
        )
        request_id = req.request_id or uuid.uuid4().hex
        if req.images:
            try:  # decoded in a thread: a large image must not stall this loop (and the replies of every request)
                pixels = await asyncio.to_thread(decode_images, req.images, request_id)
            except ImageLoadError as e:  # the row's problem, not the engine's: the controller counts and skips it
                return Error(message=str(e), kind="bad_image")
            prompt = self._prompt(prompt_token_ids=list(req.prompt_ids), multi_modal_data={"image": pixels})
        else:
            prompt = self._prompt(prompt_token_ids=list(req.prompt_ids))
        self.meter.request_started(time.monotonic())
        try:
            # LoRA: every request carries the policy's slot (none before the first adapter version: v0 is the base)
            lora = self.adapter.request if self.adapter is not None else None
            final = await self.engine.generate(request_id, prompt, params, lora)
        finally:
            self.meter.request_finished(time.monotonic())
        routes = self.engine.routes.pop(final.request_id, b"") if self.engine.route_capture else b""
        if not final.outputs:
            raise RuntimeError(f"request {request_id}: vLLM returned no output")
        comp = final.outputs[0]
        token_ids = list(comp.token_ids)
        if self.vllm_routes is not None:
            routes = vllm_routes(comp, len(token_ids), self.vllm_routes, self.name)
        logprobs = [float(lp[t].logprob) for lp, t in zip(comp.logprobs or [], token_ids)]
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"request {request_id}: {len(logprobs)} logprobs for {len(token_ids)} tokens")
        return Generated(
            request_id=req.request_id,
            token_ids=token_ids,
            logprobs=logprobs,
            top_logprobs=top_k_of(comp.logprobs or [], req.top_logprobs),
            versions=self._versions(comp.weight_versions, len(token_ids)),
            finish_reason=str(comp.finish_reason or "abort"),
            engine=self.name,
            routes=routes,
            prompt_ids=[int(t) for t in final.prompt_token_ids or []] if req.images else [],
        )

    async def score(self, req: Score) -> Scored:
        """The log-probability of each token of ``req.token_ids`` from ``req.start`` on (vLLM's prompt logprobs of
        a one-token greedy request; its one generated token is thrown away). A sequence longer than max_model_len
        or a ``start`` outside it is vLLM's or this check's ValueError: an Error answer for this request alone."""
        ids = list(req.token_ids)
        if not 1 <= req.start < len(ids):
            raise ValueError(f"Score: start {req.start} outside 1..{len(ids) - 1} ({len(ids)} tokens)")
        params = self._params(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=req.top_k, detokenize=False,
                              output_kind=self._final_only, skip_clone=True)
        request_id = req.request_id or uuid.uuid4().hex
        self.meter.request_started(time.monotonic())
        try:
            final = await self.engine.generate(request_id, self._prompt(prompt_token_ids=ids), params, None)
        finally:
            self.meter.request_finished(time.monotonic())
        positions = list(final.prompt_logprobs or [])[req.start:]
        if len(positions) != len(ids) - req.start or any(p is None for p in positions):
            raise RuntimeError(f"request {request_id}: vLLM returned {len(positions)} prompt logprobs for "
                               f"{len(ids) - req.start} scored tokens")
        return Scored(request_id=req.request_id, logprobs=[float(p[t].logprob) for p, t in zip(positions, ids[req.start:])],
                      top_logprobs=top_k_of(positions, req.top_k), engine=self.name)

    def _load_adapter(self, llm: Any, version: int, tensors: dict[str, Any]) -> dict[str, Any]:
        """LoRA: the verified ``tensors`` of ``version`` (taken out of the receive buffers beside generation) into
        the policy's slot through vLLM's add_lora (on the engine thread, between two steps; the folder staged
        beside generation: engine/lora.py). vLLM builds the new adapter before it drops the old one: a refused
        adapter leaves the served one intact (touched False)."""
        t0 = time.perf_counter()
        from flashrl.wire.protocol import AdapterRefused

        try:
            self.adapter.load(llm, version, tensors)
        except AdapterRefused as e:  # per load: the slot keeps the previous version, the engine goes on
            log.error("%s: %s (refused versions so far: %d)", self.name, e, self.adapter.refused)
            return {"ok": False, "touched": False, "refused": True, "error": str(e),
                    "load_s": time.perf_counter() - t0}
        return {"ok": True, "touched": True, "error": "", "load_s": time.perf_counter() - t0}

    def _versions(self, spans: Any, n: int) -> list[int]:
        if not spans:
            # No label reported (no tokens, or an output vLLM did not label): stamp the current version.
            return [self.version] * n
        versions: list[int] = []
        for span in spans:
            versions += [int(span.version)] * (span.end - span.start)
        if len(versions) != n:
            raise RuntimeError(f"weight-version spans cover {len(versions)} of {n} tokens")
        return versions

    async def update_weights(self, msg: UpdateWeights) -> WeightsUpdated:
        manifest = msg.manifest
        manifest_json = msgspec.json.encode(manifest).decode()
        version = manifest.version

        bucket = self.sync_load == "bucket" and self.adapter is None  # an adapter is small: loaded whole

        def receive(llm: Any) -> dict[str, Any]:
            # Beside generation (a thread of its own): buffers of its own only, nothing of vLLM's is touched.
            # Bucket mode receives and verifies the first bucket only here; the rest arrives during the load.
            method = "flashrl_open_stream" if bucket else "flashrl_receive_weights"
            got = llm.collective_rpc(method, args=(manifest_json,))[0]
            if got["ok"] and self.adapter is not None:  # LoRA: the verified tensors out of the buffers, here too
                took = llm.collective_rpc("flashrl_take_weights", args=(version,))[0]
                got = {**got, "ok": took["ok"], "error": took["error"], "tensors": took["tensors"]}
                if took["ok"]:  # its folder written here too: the paused load only runs add_lora
                    self.adapter.stage(version, took["tensors"])
            return got

        occupancy: dict[str, float] = {}

        def load(llm: Any) -> tuple[dict[str, Any], float, float]:
            # On the engine thread, between two steps: nothing generates until this returns.
            t_in = time.perf_counter()
            # read here, on the engine thread: from one update's start to the next, each counted once
            occupancy.update(self.engine.occupancy())
            try:
                if self.adapter is not None:
                    res = self._load_adapter(llm, version, got["tensors"])
                else:
                    res = llm.collective_rpc("flashrl_load_stream" if bucket else "flashrl_load_weights", args=(version,))[0]
            except Exception as e:  # the worker's own errors are answers; this is anything else: the model's
                # state is unknown, so it is treated as partly loaded (never served)
                log.exception("%s: weights v%d: the load raised", self.name, version)
                res = {"ok": False, "touched": True, "error": f"the load raised {type(e).__name__}: {e}",
                       "load_s": time.perf_counter() - t_in}
            if res["ok"]:
                llm.set_weight_version(str(version))
                # Requests in flight drop their KV (computed with the old weights) and recompute it
                # with the new ones; the tokens they already have keep their old version label.
                llm.reset_prefix_cache(reset_running_requests=True)
                # ... and a VLM's cached vision embeddings (vLLM reuses them by the image's hash): the old
                # vision tower's; without this a request with an image seen before killed the engine
                # ("Encoder cache miss", flashrl/vision/__init__.py). Text-only models: not called.
                if llm.model_config.is_multimodal_model:
                    llm.reset_encoder_cache()
            if not res["ok"] and res["touched"]:
                self.engine.halt()  # half-loaded weights: not one more step
            else:
                self.engine.unpause()  # an update ends with the engine generating, even if it was paused
            return res, t_in, time.perf_counter()

        async with self._update_lock:
            t0 = time.perf_counter()
            received = asyncio.ensure_future(self.engine.beside(receive, "weights"))
            await _inject_sync_fault(self.name, version)
            got = await received
            t_received = time.perf_counter()
            if got["ok"]:
                res, t_paused, t_loaded = await self.engine.call(load)
            else:  # rejected: nothing was loaded, the engine never stopped
                await self.engine.resume()  # as after any update: generating, even if it was paused
                res, t_paused, t_loaded = {"ok": False, "touched": False, "error": got["error"], "load_s": 0.0}, \
                    t_received, t_received
            # the version moves only here: every bucket verified and loaded (never on a partial load)
            extra = max(int(got.get("extra_bytes", 0)), int(res.get("extra_bytes", 0)))
            if res["ok"]:
                self.version = version
            elif res["touched"]:
                log.error("%s: weights v%d: %s; engine/sync_extra_bytes %d", self.name, version, res["error"], extra)
                what = "a bucket failed mid-load" if bucket else "they passed their checksums but failed to load"
                raise EngineFatal(f"weights v{version}: {what}, the engine holds partly-loaded weights and stopped "
                                  f"serving (it keeps v{self.version} as its version and exits; a restarted engine "
                                  f"gets verified weights): {res['error']}")
            seconds = time.perf_counter() - t0
        timings = {
            "receive_s": got["receive_s"] - got["verify_s"],  # beside generation
            "verify_s": got["verify_s"] + res.get("verify_s", 0.0),  # beside generation (bucket mode: mostly in the load)
            "pause_s": t_paused - t_received,  # waiting for the engine's current step to end
            "load_s": res["load_s"],
            # the version label and the KV reset, beyond the worker's own time
            "rpc_s": max(0.0, t_loaded - t_paused - res["load_s"]),
            "resume_s": t0 + seconds - t_loaded,
        }
        log.info(
            "%s: weights v%d %s in %.3fs (%s load: receive %.3fs beside generation, load %.3fs; "
            "engine/sync_extra_bytes %d)%s",
            self.name, version, "loaded" if res["ok"] else "REJECTED", seconds, self.sync_load,
            got["receive_s"], res["load_s"], extra, "" if res["ok"] else f": {res['error']}",
        )
        return WeightsUpdated(version=self.version, ok=bool(res["ok"]), seconds=seconds, error=str(res["error"]),
                              timings=timings, occupancy=occupancy, extra_bytes=extra,
                              adapter_refused=bool(res.get("refused", False)))


FAULT_ENV = "FLASHRL_FAULT_KILL_IN_SYNC"


async def _inject_sync_fault(name: str, version: int) -> None:
    """Fault injection for tests and chaos runs: ``FLASHRL_FAULT_KILL_IN_SYNC=<engine>@<version>@<marker file>``
    SIGKILLs this engine's whole process group while it receives the weights of
    ``version`` (or later), once per marker file (a restarted engine is spared)."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    engine, at, marker = spec.split("@", 2)
    if engine != name or version < int(at):
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    log.critical("%s: fault injection (%s): killing the engine during the weight sync to v%d", name, FAULT_ENV, version)
    await asyncio.sleep(0.2)  # the worker is inside the broadcast by now
    os.killpg(os.getpgrp(), signal.SIGKILL)


# --------------------------------------------------------------------------- process wrapper
def yield_cpu(nice: int) -> None:
    """Lower this engine's CPU priority by ``nice`` (engine.nice): the process and, on Linux with autogroup scheduling, its session, which is what competes with the
    trainer's and controller's sessions for the cores (every flashrl child has a session of its own,
    so a plain nice would only order the processes inside this one)."""
    if nice <= 0:
        return
    os.nice(nice)
    with contextlib.suppress(OSError):  # no autogroup (kernel option off, not Linux): the nice alone
        Path("/proc/self/autogroup").write_text(str(nice))


def engine_kwargs(opts: EngineSpec) -> dict[str, Any]:
    """vLLM's engine arguments for ``opts`` (``EngineArgs(**engine_kwargs(opts))``; bench/engine_inproc.py too)."""
    from flashrl.engine.lora import lora_engine_kwargs
    from flashrl.engine.weights import WORKER_EXTENSION

    kwargs: dict[str, Any] = {"distributed_executor_backend": "uni"}
    if opts.device == "cpu":
        kwargs["enforce_eager"] = True
        kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_gib * (1 << 30))
        # Every request is seeded (reproducible rollouts). With chunked prefill, vLLM discards the token
        # sampled for a partly prefilled request and rewinds its generator's offset, which CPU torch
        # generators do not have ("CPU Generator does not use offset": the engine dies once a burst of
        # prompts exceeds the token budget). Whole prefills only, with a budget that fits any prompt.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(opts.max_model_len, 2048)
    else:
        kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
    if opts.routes and choose_route_source(opts.device, opts.route_source)[0] == "vllm":
        kwargs["enable_return_routed_experts"] = True  # vLLM's own capture (flashrl/moe/source.py)
        kwargs["enable_prefix_caching"] = True  # its AuxOutput connector requires it
    return dict(
        model=opts.model,
        dtype=opts.dtype,
        max_model_len=opts.max_model_len,
        max_num_seqs=opts.max_num_seqs,
        seed=opts.seed,
        # The logprob of each sampled token under the distribution it was sampled from: log-softmax of
        # logits / temperature after top-k/top-p (vLLM's Sampler.sample -> TopKTopPSampler); greedy
        # requests get the untempered log-softmax. "raw_logprobs" (vLLM's default) would be the
        # temperature-1 distribution, against which every importance weight at T != 1 is wrong.
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        **kwargs,
        **(lora_engine_kwargs(opts.lora_rank) if opts.lora_rank else {}),
    )


def build_engine(opts: EngineSpec, meter: LoadMeter, loop: asyncio.AbstractEventLoop) -> InprocEngine:
    """Create vLLM's LLMEngine in this process and the thread that steps it (~1 s on the CPU for the tiny
    model, after ~4 s importing vLLM)."""
    with paused_gc():
        require_vllm()  # an older vLLM: a clear error naming the version to install, before anything is built
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

    # The EngineCore and the model run in this process (InprocClient, UniProcExecutor): no second
    # process to spawn and import torch + vLLM into, no socket between the requests and the scheduler
    # (engine/inproc.py). LLMEngine reads this variable to choose; it must not leak in as "1".
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(opts)), stat_loggers=[stat_logger_factory(meter)],
                                     enable_multiprocessing=False)
    return InprocEngine(llm, loop, name=opts.name)


async def _serve(opts: EngineSpec) -> int:
    from flashrl.wire.keys import CurveKeys
    from flashrl.wire.transport import RpcServer

    t0 = time.perf_counter()
    keys = CurveKeys.from_env()  # set by the launcher when sockets are off loopback
    # bound before vLLM is built (~20 s), the address cannot be taken meanwhile; requests (the launcher's Ping)
    # wait in the socket until the engine is up and serving
    try:
        rpc = RpcServer(opts.address, ENGINE_REQUESTS, lambda msg: server.handle(msg), name=opts.name,
                        curve=keys.server() if keys is not None else None)
    except zmq.ZMQError as e:
        if e.errno != zmq.EADDRINUSE:
            raise
        log.error("%s: %s is taken by another process (%s); exiting with code %d: the launcher starts it again "
                  "on a new address", opts.name, opts.address, e, EXIT_ADDRESS_IN_USE)
        return EXIT_ADDRESS_IN_USE
    meter = LoadMeter(time.monotonic())
    engine = build_engine(opts, meter, asyncio.get_running_loop())
    adapter = None
    if opts.lora_rank:
        from flashrl.engine.lora import PolicyAdapter, adapter_root

        adapter = PolicyAdapter(adapter_root(opts.name), opts.lora_config)
    server = EngineServer(engine, opts.name, meter, opts.sync_load, adapter)
    try:
        await server.start()
        if opts.routes:
            await start_routes(opts, engine, server)
        log.info("%s: serving %s on %s (ready in %.1fs)", opts.name, opts.model, opts.address, time.perf_counter() - t0)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop.set)
        serve_task = loop.create_task(rpc.serve(), name=f"{opts.name}-rpc")
        stop_task = loop.create_task(server.stop.wait())
        fatal_task = loop.create_task(server.fatal.wait())
        await asyncio.wait({serve_task, stop_task, fatal_task}, return_when=asyncio.FIRST_COMPLETED)
        for t in (serve_task, stop_task, fatal_task):
            t.cancel()
        for t in (serve_task, stop_task, fatal_task):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if server.fatal.is_set():
            return 1
        log.info("%s: clean shutdown; engine thread %s", opts.name, engine.utilization())
        return 0
    finally:
        engine.shutdown(release=False)  # the process ends right after (serve's caller: procs.exit_now)
        if adapter is not None:
            import shutil

            shutil.rmtree(adapter.root, ignore_errors=True)


def serve(opts: EngineSpec) -> int:
    """Run one engine process until Shutdown, SIGTERM or a fatal error; return the exit code, with which the
    caller ends the process at once (``procs.exit_now``: vLLM's engine is not torn down, nor collected)."""
    logging.basicConfig(
        stream=sys.stderr,
        level=opts.log_level,
        format=f"%(asctime)s %(levelname)s {opts.name} %(name)s: %(message)s",
    )
    if opts.device == "cpu":
        # kv_cache_gib is passed as kv_cache_memory_bytes; vLLM's legacy integer-GiB variable would
        # override it, so it must not leak in from the parent's environment.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
        # The model runs eagerly on the CPU (enforce_eager), but vLLM's sampler still wraps its logprob
        # gather in torch.compile: compiled on the first step that asks for logprobs, that is 2-3 s of
        # the run's first rollouts (and of its first eval) on this machine, for no measurable gain later
        # (bench/results/engine/inproc.md). Read when vLLM's modules are imported, so set before that.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    yield_cpu(opts.nice)
    return asyncio.run(_serve(opts))


def main() -> int:
    opts = read_spec_or_exit(EngineSpec, who="python -m flashrl.engine.server", label="engine")
    child_init(f"engine {opts.name}")  # dies with the controller
    return serve(opts)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    exit_now(main())

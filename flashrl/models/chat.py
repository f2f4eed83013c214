"""Chat models: prompts and observation turns as the model's own chat template renders them, in token ids.

    env.reset -> text ──prompt_ids──> render [system?, user(text)] + generation prompt -> token ids
    engine generates turn 1 (token ids, kept as they are: never decoded and re-encoded)
    env.step  -> observation ──observation_ids(obs, turn 1 ids)──> the ids that close the assistant
              turn and open [user(obs)] + generation prompt, exactly as the template renders them
    engine generates turn 2 after prompt + turn 1 + observation ids ...

``observation_ids`` is the template's rendering difference: it renders a conversation whose last
assistant turn holds a marker, tokenizes it, and keeps the tokens after the marker's (checked to
be a prefix; a template or tokenizer that merges across it falls back to tokenizing the suffix
text alone). If the generated turn already ends with the template's turn-closing token (it stopped
on ``<|im_end|>``, say), that token is not appended twice; if it was cut off (``length``), the
closing token is appended. So for a turn that stopped on its closing token, prompt + generated +
observation ids == the template's tokenization of the whole conversation (tests/unit/test_chat.py).

Stop tokens: ``generation_config.json``'s ``eos_token_id`` (an int or a list), plus the tokenizer's
eos. What is left out: tool calls and multimodal content (text turns only), templates that need
extra render arguments (set them in the template itself).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ChatFormat", "ChatTemplateError", "stop_token_ids"]

log = logging.getLogger(__name__)

# Stands for the generated text of an assistant turn while rendering; nothing a template changes.
_MARK = "FLASHRLTURNMARK"


class ChatTemplateError(ValueError):
    """The model folder's chat template cannot be used as configured; the message says how to fix it."""


def stop_token_ids(model_dir: str | Path, tokenizer_eos: int | None = None) -> list[int]:
    """The model's stop tokens: ``eos_token_id`` of generation_config.json (int or list), then the tokenizer's eos."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as e:
            raise ChatTemplateError(f"{gen}: not valid JSON ({e}); fix or delete the file") from None
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, list):
            if not all(isinstance(x, int) for x in eos):
                raise ChatTemplateError(f"{gen}: eos_token_id must be an int or a list of ints, got {eos!r}")
            ids += eos
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    return ids


class ChatFormat:
    """Token ids of chat prompts and observation turns, rendered by ``hf``'s chat template.

    ``hf`` is a Hugging Face tokenizer with a ``chat_template``; ``system_prompt`` (may be empty)
    becomes the first (system) message of every conversation.
    """

    def __init__(self, hf: Any, system_prompt: str = "", stop_ids: Sequence[int] = ()) -> None:
        if not getattr(hf, "chat_template", None):
            raise ChatTemplateError(
                f"tokenizer at {getattr(hf, 'name_or_path', '?')!r} has no chat template; set model.chat_template = "
                '"off" (prompts go to the model as raw text) or add chat_template.jinja to the model folder'
            )
        self.hf = hf
        self.system_prompt = system_prompt
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self._head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self._warned = False
        # Render once now: a template that fails on plain text turns fails here, before any process starts.
        try:
            self.prompt_ids("hello")
            self.observation_ids("world", [])
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja errors, templates raising on unexpected roles
            raise ChatTemplateError(f"the chat template of {getattr(hf, 'name_or_path', '?')!r} cannot render a "
                                    f"system/user/assistant conversation: {type(e).__name__}: {e}") from None

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        if not isinstance(text, str):
            raise ChatTemplateError(f"apply_chat_template returned {type(text).__name__}, expected the rendered text")
        return text

    def _encode(self, text: str) -> list[int]:
        # The rendered text already holds every special token the template wants (BOS included).
        return list(self.hf.encode(text, add_special_tokens=False))

    def prompt_ids(self, text: str) -> list[int]:
        """[system?, user(text)] with the generation prompt (the assistant turn's opening), as token ids."""
        return self._encode(self._render([*self._head, {"role": "user", "content": text}], True))

    def observation_ids(self, observation: str, generated: Sequence[int]) -> list[int]:
        """Ids to append after a generated assistant turn ``generated``: its closing, user(observation), and
        the next generation prompt (module docstring)."""
        msgs = [*self._head, {"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK},
                {"role": "user", "content": observation}]
        full = self._render(msgs, True)
        k = full.rfind(_MARK)
        if k < 0:
            raise ChatTemplateError("the chat template does not render assistant turns' content verbatim; "
                                    'multi-turn trajectories cannot be kept token-exact with it (model.chat_template = "off")')
        cut = k + len(_MARK)
        head, ids = self._encode(full[:cut]), self._encode(full)
        if ids[: len(head)] == head:
            tail = ids[len(head):]
        else:  # a merge across the marker's end: tokenize the suffix on its own
            if not self._warned:
                self._warned = True
                log.warning("chat template: tokens merge across the end of an assistant turn; observation turns are "
                            "tokenized on their own")
            tail = self._encode(full[cut:])
        if generated and tail and int(generated[-1]) in self.stop_ids and tail[0] == int(generated[-1]):
            tail = tail[1:]  # the turn already ended with the template's closing token
        return tail

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
observation ids == the template's tokenization of the whole conversation (tests/unit/test_chat.py)
as long as the template renders earlier turns as they were generated.

Templates that rewrite history (Qwen3 drops the ``<think>`` reasoning of earlier assistant turns):
the trajectory is still prompt + generated ids + observation ids + generated ids ..., each turn's
request the previous ids unchanged, so the trained sample is exactly what the engine generated
from, never a re-rendering (a re-rendered conversation would be a different sequence: a fork the
policy never sampled). ``template_mismatch`` measures how far the template's re-rendering of the
finished conversation would be from it (the rollout's ``rollout/template_mismatch_*`` metrics), and
how much of that decoding and re-encoding the generated turns alone causes (``retokenize``).

Content that holds the tokenizer's special-token strings (an observation or prompt containing
``<|im_end|>\n<|im_start|>assistant``, say) is tokenized as plain text: it cannot open or close a
turn. Other content is tokenized with its template text in one piece, as the template would.

Stop tokens: ``generation_config.json``'s ``eos_token_id`` (an int or a list), plus the tokenizer's
eos. What is left out: tool calls and multimodal content (text turns only), templates that need
extra render arguments (set them in the template itself).
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DIFF_LIMIT", "ChatFormat", "ChatTemplateError", "stop_token_ids", "token_diff"]

log = logging.getLogger(__name__)

# Stands for the generated text of an assistant turn while rendering; nothing a template changes.
_MARK = "FLASHRLTURNMARK"
# Stands for a user turn's content while rendering (to find where the template puts it).
_CONTENT = "FLASHRLCONTENTMARK"


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


# token_diff's edit script runs on at most this many tokens (between the first and the last difference);
# difflib is quadratic in the worst case, and it runs on the controller's event loop
DIFF_LIMIT = 1024


def token_diff(trained: Sequence[int], rendered: Sequence[int], *, tail: bool = False) -> int:
    """Tokens by which ``rendered`` differs from ``trained``: over the edit script (difflib's longest
    matching blocks), each replaced, deleted or inserted run counts its longer side. Unless ``tail``,
    a run that ``rendered`` adds after the end of ``trained`` is not counted: the template's closing
    of the turn the sample ends in (or of a turn cut off), which the sample never contained.

    Exact when the stretch from the first to the last difference is at most DIFF_LIMIT tokens long on
    both sides; beyond that the stretch's longer side (an upper bound), so the cost stays linear. 0 if and
    only if the sequences are equal (``rendered`` may be longer when not ``tail``)."""
    a, b = list(trained), list(rendered)
    k = 0
    for x, y in zip(a, b):  # the common prefix
        if x != y:
            break
        k += 1
    if not tail and k == len(a):
        return 0  # rendered only adds after the sample's end (or is the same)
    m = 0
    while m < min(len(a), len(b)) - k and a[len(a) - 1 - m] == b[len(b) - 1 - m]:
        m += 1  # the common suffix (not overlapping the prefix)
    a, b = a[k:len(a) - m], b[k:len(b) - m]
    at_end = m == 0 and not tail  # an insert at the end of ``a`` is one after the end of the sample
    if len(a) > DIFF_LIMIT or len(b) > DIFF_LIMIT:
        return max(len(a), len(b))
    n = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal" or (tag == "insert" and i1 == len(a) and at_end):
            continue
        n += max(i2 - i1, j2 - j1)
    return n


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
        if _MARK in system_prompt or _CONTENT in system_prompt:
            raise ChatTemplateError(f"model.system_prompt must not contain {_MARK!r} or {_CONTENT!r} (flashrl's "
                                    "rendering markers)")
        self.hf = hf
        self.system_prompt = system_prompt
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self._head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self._warned = False
        self._escape_warned = False
        # The strings the tokenizer turns into special tokens (<|im_start|>, <|im_end|>, ...): content that
        # holds one is tokenized as plain text (``_content_pieces``), so it cannot open or close a turn.
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        self.special_strings = sorted(
            {str(t.content) for t in added.values() if getattr(t, "special", False)}
            | {str(t) for t in (getattr(hf, "all_special_tokens", None) or [])},
            key=len, reverse=True)
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

    def _has_special(self, text: str) -> bool:
        return any(sp in text for sp in self.special_strings)

    def _encode_plain(self, text: str) -> list[int]:
        """``text`` with special-token strings tokenized as the characters they are."""
        return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def _content_pieces(self, messages: list[dict[str, str]], content: str, start: int) -> tuple[str, str]:
        """The rendering of ``messages`` (generation prompt on) whose last message has ``content``, split
        around that content: (text before it, text after it). ``start``: where to look for it from.
        Raises ChatTemplateError when the template does not insert the content verbatim."""
        marked = self._render([*messages[:-1], {**messages[-1], "content": _CONTENT}], True)
        j = marked.find(_CONTENT, start)
        before, after = marked[:max(j, 0)], marked[j + len(_CONTENT):]
        if j < 0 or before + content + after != self._render(messages, True):
            raise ChatTemplateError(
                "an environment's text holds special-token strings of the tokenizer and the chat template does not "
                "insert user content verbatim, so it cannot be kept from opening or closing turns; have the "
                f"environment escape {self.special_strings} in what it returns")
        if not self._escape_warned:
            self._escape_warned = True
            log.warning("chat template: an environment's text holds special-token strings (%s); they are tokenized as "
                        "plain text, not as turn markers", ", ".join(s for s in self.special_strings if s in content))
        return before, after

    def prompt_ids(self, text: str) -> list[int]:
        """[system?, user(text)] with the generation prompt (the assistant turn's opening), as token ids."""
        msgs = [*self._head, {"role": "user", "content": text}]
        if not self._has_special(text):
            return self._encode(self._render(msgs, True))
        before, after = self._content_pieces(msgs, text, 0)
        return self._encode(before) + self._encode_plain(text) + self._encode(after)

    def observation_ids(self, observation: str, generated: Sequence[int]) -> list[int]:
        """Ids to append after a generated assistant turn ``generated``: its closing, user(observation), and
        the next generation prompt (module docstring)."""
        msgs = [*self._head, {"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK},
                {"role": "user", "content": observation}]
        full = self._render(msgs, True)
        # The first occurrence: the observation (rendered after it) may hold the marker's text itself.
        k = full.find(_MARK)
        if k < 0:
            raise ChatTemplateError("the chat template does not render assistant turns' content verbatim; "
                                    'multi-turn trajectories cannot be kept token-exact with it (model.chat_template = "off")')
        cut = k + len(_MARK)
        escape = self._has_special(observation)
        if escape:  # tokenize up to the observation, the observation as plain text, then the rest
            before, after = self._content_pieces(msgs, observation, cut)
            upto = before
        else:
            upto = full
        head, ids = self._encode(full[:cut]), self._encode(upto)
        if ids[: len(head)] == head:
            tail = ids[len(head):]
        else:  # a merge across the marker's end: tokenize the suffix on its own
            if not self._warned:
                self._warned = True
                log.warning("chat template: tokens merge across the end of an assistant turn; observation turns are "
                            "tokenized on their own")
            tail = self._encode(upto[cut:])
        if escape:
            tail += self._encode_plain(observation) + self._encode(after)
        if generated and tail and int(generated[-1]) in self.stop_ids and tail[0] == int(generated[-1]):
            tail = tail[1:]  # the turn already ended with the template's closing token
        return tail

    def conversation_ids(self, prompt: str, turns: Sequence[tuple[str, str | None]]) -> list[int]:
        """The template's tokenization of a whole conversation re-rendered from text: [system?,
        user(prompt)], then per turn assistant(text) and, unless None, user(observation); the
        generation prompt when it ends on a user turn. What a pipeline that re-renders conversations
        would train on; flashrl trains on the ids as generated (module docstring)."""
        msgs = [*self._head, {"role": "user", "content": prompt}]
        for text, obs in turns:
            msgs.append({"role": "assistant", "content": text})
            if obs is not None:
                msgs.append({"role": "user", "content": obs})
        return self._encode(self._render(msgs, msgs[-1]["role"] == "user"))

    def template_mismatch(self, prompt: str, turns: Sequence[tuple[Sequence[int], str | None]],
                          trained: Sequence[int]) -> tuple[int, int]:
        """How far a text re-rendering of a finished trajectory is from the ids it trains on.

        ``turns``: per generated turn its ids and the observation appended after it (None: none was);
        ``trained``: prompt + response ids of the trajectory. Returns (``template``: ``token_diff`` of
        ``trained`` and ``conversation_ids`` of the decoded turns; ``retokenize``: the tokens by which
        decoding and re-encoding each generated turn alone (its final stop token aside) changes it).
        Both 0: the template re-renders the conversation exactly; ``template`` > 0 with ``retokenize`` 0:
        the template rewrites history (Qwen3's dropped reasoning, say)."""
        texts: list[tuple[str, str | None]] = []
        retokenize = 0
        for ids, obs in turns:
            gen = [int(i) for i in ids]
            text = self.hf.decode(gen, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            texts.append((text, obs))
            body = gen[:-1] if gen and gen[-1] in self.stop_ids else gen
            again = self._encode(text)
            if again != body:
                retokenize += token_diff(body, again, tail=True)
        return token_diff(trained, self.conversation_ids(prompt, texts)), retokenize

"""The built-in character-level tokenizer: one token per character, built and loaded offline.

Vocabulary (ids are stable: tests and saved models rely on them)::

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4.. one id per character of CHARSET

``encode`` never adds special tokens (the prompt format has no BOS: the controller, the warm-start
and the engines all see exactly the characters of the prompt). ``decode`` drops special tokens and
joins characters with nothing in between (a ``Fuse`` decoder), so ``decode(encode(s)) == s`` for
every ``s`` over CHARSET.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashrl.models.chat import ChatFormat

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)

# Every character the built-in environments print or expect back. Appending is safe; reordering
# changes the ids of saved models.
CHARSET: str = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + "+-*/=()<>[],.:;?!'\"_#%&"


def build_char_tokenizer(charset: str = CHARSET):  # -> transformers.PreTrainedTokenizerFast
    """A ``PreTrainedTokenizerFast`` over ``charset`` (WordLevel, one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(charset)) != len(charset):
        raise ValueError("charset: characters must be unique")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split every character apart ([\s\S] also matches the newline, which "." does not).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,  # " ." must come back as " .", not "."
        model_max_length=1 << 20,
    )


class HFTokenizer:
    """A thin wrapper giving any Hugging Face tokenizer the ``flashrl.interfaces.ChatTokenizer`` shape.

    ``chat`` (a ``ChatFormat``, or None): prompts and observation turns rendered by the model's chat
    template. ``stop_token_ids``: the model's stop tokens (generation_config.json's eos_token_id list).
    """

    def __init__(self, hf, chat: ChatFormat | None = None, stop_token_ids: list[int] | None = None) -> None:
        self.hf = hf
        if hf.eos_token_id is None:
            raise ValueError(f"tokenizer at {hf.name_or_path!r} has no eos token; set eos_token in tokenizer_config.json")
        self.eos_token_id: int = int(hf.eos_token_id)
        # Models without a pad token pad with EOS (a masked position never reaches the loss).
        self.pad_token_id: int = int(hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id)
        self.chat = chat
        self.stop_token_ids: list[int] = list(stop_token_ids) if stop_token_ids else [self.eos_token_id]

    def encode_prompt(self, text: str) -> list[int]:
        """The first observation (the env's prompt text) as the model sees it: chat-rendered or raw."""
        return self.chat.prompt_ids(text) if self.chat is not None else self.encode(text)

    def encode_observation(self, text: str, generated: list[int]) -> list[int]:
        """Ids appended after the generated turn ``generated`` for the env's next observation ``text``."""
        return self.chat.observation_ids(text, generated) if self.chat is not None else self.encode(text)

    def template_mismatch(self, prompt: str, turns: Sequence[tuple[Sequence[int], str | None]],
                          trained: Sequence[int]) -> tuple[int, int] | None:
        """(template, retokenize) token differences of a finished trajectory (ChatFormat.template_mismatch);
        None without a chat template (raw text: no template to re-render with)."""
        return self.chat.template_mismatch(prompt, turns, trained) if self.chat is not None else None

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


class TokenizerFile:
    """The part of a Hugging Face fast tokenizer that ``HFTokenizer`` uses, read from ``tokenizer.json`` by
    the ``tokenizers`` library alone: no transformers (and so no torch) import.

    For the generic fast tokenizer classes (``load_tokenizer`` checks), transformers adds nothing to
    ``tokenizer.json`` for what flashrl asks of it: encoding without special tokens, decoding without
    them and without clean-up. Loading it this way takes ~0.05 s instead of ~5 s of CPU, which the
    controller spent while the engines and the trainer were importing on the same cores.
    """

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self.name_or_path = str(path.parent)
        self._tok = Tokenizer.from_file(str(path))
        # Like the transformers class: a single text is neither truncated nor padded, whatever the file says.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.eos_token_id = self._special_id(config, "eos_token")
        self.pad_token_id = self._special_id(config, "pad_token")

    def _special_id(self, config: dict[str, Any], key: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # an AddedToken written out: {"content": ..., ...}
            token = token.get("content")
        if token is None:
            return None
        tid = self._tok.token_to_id(str(token))
        if tid is None:  # transformers would add it as a new token: leave such a folder to transformers
            raise LookupError(f"{self.name_or_path}/tokenizer_config.json: {key} {token!r} is not in tokenizer.json")
        return tid

    def __len__(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    # The defaults are transformers' (``.hf`` stands in for a transformers tokenizer; callers may rely on them).
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("TokenizerFile.decode: clean-up of tokenization spaces needs the transformers tokenizer")
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


# tokenizer_config.json of a folder that TokenizerFile reads as transformers would: the generic fast classes,
# and no key that makes transformers change the tokenizer (add_prefix_space, legacy, a chat template, ...).
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_HARMLESS_KEYS = frozenset({"backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
                            "clean_up_tokenization_spaces", "model_max_length", "added_tokens_decoder"})
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")


def _tokenizer_file(p: Path, chat_template: str, system_prompt: str) -> TokenizerFile | None:
    """``TokenizerFile`` for the folder ``p`` when it reads the same as transformers' tokenizer; else None."""
    if system_prompt or chat_template == "on" or not (p / "tokenizer.json").is_file():
        return None
    try:
        config = json.loads((p / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None  # transformers reports it
    if not isinstance(config, dict) or config.get("tokenizer_class") not in _GENERIC_CLASSES:
        return None
    if set(config) - _HARMLESS_KEYS or any((p / f).exists() for f in _TEMPLATE_FILES):
        return None  # a chat template, or an option transformers applies: the transformers tokenizer
    if (p / "special_tokens_map.json").exists() or config.get("eos_token") is None:
        return None
    try:
        return TokenizerFile(p / "tokenizer.json", config)
    except LookupError:
        return None


def load_tokenizer(path: str | Path, chat_template: str = "auto", system_prompt: str = "") -> HFTokenizer:
    """Load the tokenizer saved in the model folder ``path`` (offline).

    ``chat_template`` (model.chat_template): "auto" renders prompts with the folder's chat template when
    it has one, "on" requires one (ChatTemplateError otherwise), "off" sends raw prompt text.
    ``system_prompt`` (model.system_prompt) is the system message of chat prompts.
    A generic fast tokenizer without a chat template (the built-in model's) is read by the tokenizers
    library alone (``TokenizerFile``); everything else by transformers' ``AutoTokenizer``.
    """
    from flashrl.models.chat import ChatFormat, ChatTemplateError, stop_token_ids

    p = Path(path)
    if not (p / "tokenizer_config.json").is_file() and not (p / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{p}: no tokenizer files (tokenizer.json / tokenizer_config.json); "
                                "point model.path at a Hugging Face model folder or use builtin:tiny")
    plain = _tokenizer_file(p, chat_template, system_prompt)
    if plain is not None:
        return HFTokenizer(plain, None, stop_token_ids(p, plain.eos_token_id))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    chat = None
    if chat_template == "on" or (chat_template == "auto" and getattr(hf, "chat_template", None)):
        chat = ChatFormat(hf, system_prompt, stop_token_ids(p, hf.eos_token_id))
    elif system_prompt:
        why = "model.chat_template is off" if chat_template == "off" else f"{p} has no chat template"
        raise ChatTemplateError(f"model.system_prompt is set but {why}: a system prompt needs a chat template")
    return HFTokenizer(hf, chat, stop_token_ids(p, hf.eos_token_id))

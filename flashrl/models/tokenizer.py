"""The built-in character-level tokenizer: one token per character, built and loaded offline.

Vocabulary (ids are stable: tests and saved models rely on them)::

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4.. one id per character of CHARSET

``encode`` never adds special tokens (the prompt format has no BOS: the controller, the warm-start
and the engines all see exactly the characters of the prompt). ``decode`` drops special tokens and
joins characters with nothing in between (a ``Fuse`` decoder), so ``decode(encode(s)) == s`` for
every ``s`` over CHARSET.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

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

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def load_tokenizer(path: str | Path, chat_template: str = "auto", system_prompt: str = "") -> HFTokenizer:
    """Load the tokenizer saved in the model folder ``path`` (offline).

    ``chat_template`` (model.chat_template): "auto" renders prompts with the folder's chat template when
    it has one, "on" requires one (ChatTemplateError otherwise), "off" sends raw prompt text.
    ``system_prompt`` (model.system_prompt) is the system message of chat prompts.
    """
    from transformers import AutoTokenizer

    from flashrl.models.chat import ChatFormat, ChatTemplateError, stop_token_ids

    p = Path(path)
    if not (p / "tokenizer_config.json").is_file() and not (p / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{p}: no tokenizer files (tokenizer.json / tokenizer_config.json); "
                                "point model.path at a Hugging Face model folder or use builtin:tiny")
    hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    chat = None
    if chat_template == "on" or (chat_template == "auto" and getattr(hf, "chat_template", None)):
        chat = ChatFormat(hf, system_prompt, stop_token_ids(p, hf.eos_token_id))
    elif system_prompt:
        why = "model.chat_template is off" if chat_template == "off" else f"{p} has no chat template"
        raise ChatTemplateError(f"model.system_prompt is set but {why}: a system prompt needs a chat template")
    return HFTokenizer(hf, chat, stop_token_ids(p, hf.eos_token_id))

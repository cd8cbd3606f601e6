"""Text <-> token ids for a model, built from GGUF metadata or a Hugging Face folder.

GGUF files carry no tokenizer.json, only llama.cpp's metadata keys. We rebuild an equivalent
`tokenizers.Tokenizer` from them so that prompts tokenize exactly as llama.cpp would:

* ``gpt2``: byte-level BPE with the file's merges; the split regex comes from ``tokenizer.ggml.pre``.
* ``llama``: SentencePiece BPE (Llama 2, Mistral, Mixtral): merges are ranked by the score of the
  token they produce, spaces become ``▁``, unknown characters fall back to ``<0xXX>`` byte tokens.
* ``gemma4``: BPE with the file's merges over raw UTF-8, spaces as ``▁``, byte fallback.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from functools import cache, cached_property
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from backend.errors import ModelLoadError

# llama.cpp's token types (llama_token_type / gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPACE = "\u2581"  # SentencePiece's visible space
_GEMMA4_EOG = ("<turn|>", "<|tool_response>")

# Split regexes for byte-level vocabularies whose merges were learned on other splits than GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: Qwen2's, with combining marks (\p{M}) part of a word rather than of the
# punctuation after it.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss; llama.cpp's "gpt-4o"): case-aware words with their contractions,
# numbers in threes, punctuation runs keeping a trailing newline or slash.
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "gpt-4o": _O200K_SPLIT,
}
# These split every digit apart first, then apply the GPT-2 regex (llama.cpp: "\p{N}" + gpt2).
_DIGIT_PRES = {"smollm", "starcoder", "refact"}
# Llama 3 style vocabularies look a whole pre-token up before merging (llama.cpp "ignore_merges").
_WHOLE_WORD_PRES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe"}


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 maps to itself, the rest
    (controls, space, soft hyphen) is moved to U+0100 onwards so every token is visible text."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    moved = (b for b in range(256) if b not in table)
    table.update({b: chr(0x100 + n) for n, b in enumerate(moved)})
    return table


def _first_ids(tokens: list[str]) -> dict[str, int]:
    """Token -> id; a few files repeat a token (padding filler), the first id wins."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


def _byte_level_backend(
    tokens: list[str], types: list[int], merges: list[str], pre: str
) -> BackendTokenizer:
    """Byte-level BPE as llama.cpp runs a ``gpt2`` vocabulary."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Normal tokens must be in the byte alphabet for BPE to reach them; a converter sometimes stores
    # one raw. Control/user-defined tokens stay raw: they are matched whole in the text.
    tokens = [
        "".join(alphabet[b] for b in tok.encode("utf-8"))
        if kind == _NORMAL and not set(tok) <= spelled
        else tok
        for tok, kind in zip(tokens, types, strict=True)
    ]
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    model = BPE(vocab=_first_ids(tokens), merges=pairs, ignore_merges=pre in _WHOLE_WORD_PRES)
    backend = BackendTokenizer(model)
    if pre in _SPLIT_BY_PRE:
        split = pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre in _DIGIT_PRES:
        digits = pre_tokenizers.Digits(individual_digits=True)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        # llama.cpp also falls back to the GPT-2 regex for a pre-tokenizer it does not know.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _gemma4_backend(tokens: list[str], merges: list[str]) -> BackendTokenizer:
    """BPE over raw UTF-8 with byte fallback as llama.cpp runs a ``gemma4`` vocabulary:
    spaces become ``▁`` (no dummy prefix), and merges run over each line and each run of
    newlines, nothing else splitting the text."""
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(BPE(vocab=_first_ids(tokens), merges=pairs, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    undo = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(undo)
    return backend


def _score_merges(
    tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-greedy merging.

    SentencePiece repeatedly joins the adjacent pair whose result is the highest-scoring token, so
    every way of cutting a normal token into two normal tokens is a merge, ranked by that score.
    """
    pieces = {tok: i for i, tok in enumerate(tokens) if types[i] == _NORMAL}
    ranked = []
    for token, index in pieces.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_backend(
    tokens: list[str], types: list[int], scores: list[float], meta: Mapping[str, object]
) -> BackendTokenizer:
    """SentencePiece BPE with byte fallback as llama.cpp runs a ``llama`` vocabulary."""
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    merges = _score_merges(tokens, types, scores)
    model = BPE(_first_ids(tokens), merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = BackendTokenizer(model)
    # llama.cpp (and SentencePiece) add the dummy space to every text run, including the one after
    # a special token ("<s>[INST]" -> "<s>▁[INST]"), and keep leading spaces ("  hi" -> "▁▁▁hi").
    # A normalizer does both; the Metaspace pre-tokenizer would swallow an existing leading space.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    undo = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        undo.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(undo)
    return backend


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"cannot read JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A model's tokenizer: encoding, decoding, special ids and its chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
        vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        # Ordered and deduplicated: the first is the model's main EOS (its eos_token).
        self._eos_ids = tuple(dict.fromkeys(eos_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, object], path: str | Path) -> Tokenizer:
        """Build from GGUF key/value metadata (plain Python values) of the file at ``path``."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind not in ("gpt2", "llama", "gemma4"):
            raise ModelLoadError(path, f"unsupported tokenizer model '{kind}'")
        if not isinstance(tokens, list) or not tokens:
            raise ModelLoadError(path, "tokenizer.ggml.tokens is missing")
        types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if not isinstance(types, list) or len(types) != len(tokens):
            raise ModelLoadError(path, "tokenizer.ggml.token_type does not match the tokens")
        if kind in ("gpt2", "gemma4"):
            merges = meta.get("tokenizer.ggml.merges")
            if not isinstance(merges, list):
                raise ModelLoadError(path, "tokenizer.ggml.merges is missing")
            pre = str(meta.get("tokenizer.ggml.pre", "default"))
            if kind == "gemma4":
                backend = _gemma4_backend(tokens, merges)
            else:
                backend = _byte_level_backend(tokens, types, merges, pre)
        else:
            scores = meta.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) != len(tokens):
                raise ModelLoadError(path, "tokenizer.ggml.scores is missing")
            backend = _sentencepiece_backend(tokens, types, scores, meta)
        # Control tokens ("<|im_start|>", "<s>") and user-defined ones ("<think>") are matched
        # whole in the text, never cut by BPE; only control/unknown ones count as special.
        added = [
            AddedToken(tok, special=kind_ != _USER_DEFINED, normalized=False)
            for tok, kind_ in zip(tokens, types, strict=True)
            if kind_ in (_CONTROL, _UNKNOWN, _USER_DEFINED)
        ]
        backend.add_special_tokens([token for token in added if token.special])
        backend.add_tokens([token for token in added if not token.special])

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return value if isinstance(value, int) and 0 <= value < len(tokens) else None

        eos = [token_id(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        # Gemma 4 files name only <eos>; llama.cpp also ends generation at the end of a turn
        # and where the model waits for a tool's response.
        if kind == "gemma4":
            ids = {tok: i for i, tok in enumerate(tokens) if tok in _GEMMA4_EOG}
            eos += [ids[tok] for tok in _GEMMA4_EOG if tok in ids]
        template = meta.get("tokenizer.chat_template")
        return cls(
            backend,
            bos_id=token_id("bos_token_id"),
            eos_ids=[i for i in eos if i is not None],
            # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise,
            # and to Gemma 4's whatever it says.
            add_bos=kind == "gemma4"
            or bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            chat_template=template if isinstance(template, str) else None,
            vocab_size=len(tokens),
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Build from a Hugging Face model folder (tokenizer.json and its config files)."""
        folder = Path(folder)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(file, "file not found (the tokenizer is required)")
        try:
            backend = BackendTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise ModelLoadError(file, f"cannot load tokenizer: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")

        def token_id(value: object) -> int | None:
            text = _token_text(value)
            return backend.token_to_id(text) if text is not None else None

        bos_id = token_id(config.get("bos_token"))
        extra = generation.get("eos_token_id")
        eos_ids = [
            token_id(config.get("eos_token")),
            *(extra if isinstance(extra, list) else [extra]),
        ]
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: the tokenizer.json post-processor (e.g. Llama 3's template) decides.
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and probe[:1] == [bos_id]
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=[i for i in eos_ids if isinstance(i, int)],
            add_bos=bool(add_bos),
            chat_template=cls._hf_chat_template(folder, config),
        )

    @staticmethod
    def _hf_chat_template(folder: Path, config: dict) -> str | None:
        """chat_template.jinja (newer layout) or tokenizer_config.json's chat_template."""
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default", next(iter(named.values()), None))
        return template if isinstance(template, str) else None

    @property
    def eos_ids(self) -> set[int]:
        """Ids that end the assistant's turn (eos plus end-of-turn/-message tokens)."""
        return set(self._eos_ids)

    @property
    def bos_token(self) -> str:
        """The BOS token's text, for chat templates ("" when there is none)."""
        return (self.id_to_token(self.bos_id) if self.bos_id is not None else None) or ""

    @property
    def eos_token(self) -> str:
        """The main EOS token's text, for chat templates ("" when there is none)."""
        return (self.id_to_token(self._eos_ids[0]) if self._eos_ids else None) or ""

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids for ``text``; special-token strings in it become their ids. ``add_special``
        prepends BOS when the model wants it."""
        # encode_batch lets go of the GIL while it works (encode holds it: 3.2 s for 3 MB of
        # text, every other thread stopped); one text through it costs the same.
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for ``ids``; ``skip_special`` drops control tokens such as <|im_end|>."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token's vocabulary spelling, or None."""
        return self.backend.token_to_id(token)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token decodes to: a text longer than ``n`` times this
        is more than ``n`` tokens, which is known without tokenizing it. One batch call:
        a decode per token held the interpreter for ~150 ms beside a busy engine."""
        texts = self.backend.decode_batch([[i] for i in range(self.vocab_size)])
        return max(1, max(map(len, texts)))

    def special_id(self, text: str) -> int | None:
        """The id of the special (control) token spelled ``text``, or None if ``text`` is
        not one: such a token is written only by its id, never by the bytes of its text."""
        i = self.backend.token_to_id(text)
        added = self.backend.get_added_tokens_decoder().get(i) if i is not None else None
        return i if added is not None and added.special else None

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of an id, or None when out of range."""
        return self.backend.id_to_token(token_id)

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Turns ids arriving one at a time into text, emitting only complete characters.

    Decoding each id alone would break multi-byte characters split over byte tokens and lose
    SentencePiece's leading spaces (the decoder strips the first one). Instead we decode a short
    window twice, with and without the newest ids, and emit the difference: both decodes start at
    the same token, so whatever the decoder does to the start cancels out.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # window start: one emitted step back, for context
        self._read = 0  # everything before this is already emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text ("" while a character is incomplete)."""
        self._ids.append(token_id)
        before, after = self._window()
        # A trailing U+FFFD means the last token ended mid-character: wait for the rest.
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes as U+FFFD)."""
        before, after = self._window()
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]

    def _window(self) -> tuple[str, str]:
        """The window's text without and with the ids not yet emitted."""
        window = self._ids[self._prefix :]
        decode = self._tokenizer.decode
        done = self._read - self._prefix
        return decode(window[:done], self._skip_special), decode(window, self._skip_special)

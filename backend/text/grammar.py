"""Constrained decoding: a request's grammar as the set of tokens it admits next.

llguidance (the library llama.cpp and vLLM use) matches a grammar against the model's
own tokenizer, so a mask admits exactly the tokens whose bytes can continue a match.
The next mask is computed on a worker thread right after a token is accepted: the call
releases the GIL, so it runs while the engine thread works through the request's layers
(and other requests' jobs), and the sampler rarely waits for it.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from backend.config import Grammar
from backend.errors import BevyError
from backend.text.tokenizer import Tokenizer

_lock = threading.Lock()
# Per tokenizer (dropped with it, e.g. when the app loads another model) and vocab size.
_tokenizers: weakref.WeakKeyDictionary[Tokenizer, dict[int, llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_executor: ThreadPoolExecutor | None = None
_BITS = torch.arange(32, dtype=torch.int32)
# JSON as json.dumps writes it: with free whitespace a weak model can pad a reply with
# blanks until max_tokens. A schema's own "x-guidance" options override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _ll_tokenizer(tok: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of ``tok``, built once per tokenizer (it walks the whole vocab)."""
    with _lock:
        built = _tokenizers.setdefault(tok, {})
        if vocab_size not in built:
            built[vocab_size] = llguidance.LLTokenizer(
                tok.backend.to_str(), n_vocab=vocab_size, eos_token=list(tok.eos_ids)
            )
        return built[vocab_size]


def prepare(tok: Tokenizer, vocab_size: int) -> None:
    """Build llguidance's view of the tokenizer now (~0.2 s, holding the GIL), when a
    model loads, rather than in the engine's loop when the first grammar arrives."""
    _ll_tokenizer(tok, vocab_size)


def _worker() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bevy-grammar")
        return _executor


def grammar_text(spec: Grammar) -> str:
    """``spec`` in the form llguidance's matcher takes; ValueError if it cannot be read."""
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_LAYOUT)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    lark = gbnf_to_lark(spec.source) if spec.kind == "gbnf" else spec.source
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Matcher:
    """One request's place in its grammar.

    ``allowed()`` is the mask for the next token; ``accept(token)`` moves on and starts
    computing the following mask; ``done`` once the grammar admits nothing more. Time
    spent computing masks and waiting for them is kept (``mask_s``, ``wait_s``)."""

    def __init__(self, tok: Tokenizer, vocab_size: int, spec: Grammar) -> None:
        try:
            text = grammar_text(spec)
        except Exception as exc:  # a schema that is not JSON, a GBNF syntax error
            raise BevyError(f"invalid {spec.kind} grammar: {exc}") from None
        self._m = llguidance.LLMatcher(_ll_tokenizer(tok, vocab_size), text, log_level=0)
        if self._m.is_error():
            raise BevyError(f"invalid {spec.kind} grammar: {self._m.get_error()}")
        self.vocab_size = vocab_size
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        self._next: Future | None = None
        self.mask_s = self.wait_s = 0.0
        self.steps = 0
        # Read between masks only: the matcher is never touched while the worker uses it.
        self._done, self._accepting = self._m.is_stopped(), self._m.is_accepting()
        if not self._done:
            self._start()

    def _fill(self) -> None:
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        self.mask_s += time.perf_counter() - t0

    def _start(self) -> None:
        self._next = _worker().submit(self._fill)

    def allowed(self) -> torch.Tensor | None:
        """Bool [vocab_size]: the tokens that may come next; None if the matcher failed
        (a grammar too complex for its limits) or admits no token at all (``error``)."""
        t0 = time.perf_counter()
        if self._next is not None:
            self._next.result()
            self._next = None
        self.wait_s += time.perf_counter() - t0
        self.steps += 1
        mask = ((self._words[:, None] >> _BITS) & 1).flatten()[: self.vocab_size].bool()
        if self._m.is_error() or not mask.any():
            self._done = True
            return None
        return mask

    @property
    def error(self) -> str:
        """Why the grammar cannot go on (after ``allowed`` returned None)."""
        return self._m.get_error() or "the grammar admits no token of this model here"

    def accept(self, token: int) -> bool:
        """Consume ``token``; False if the grammar refused it (it then admits nothing)."""
        self.close()
        ok = self._m.consume_token(token)
        self._done = not ok or self._m.is_stopped() or self._m.is_error()
        self._accepting = ok and self._m.is_accepting()
        if not self._done:
            self._start()
        return ok

    @property
    def done(self) -> bool:
        """Nothing more may follow (the match is complete, or the matcher failed)."""
        return self._done

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (more may follow: EOS is admitted)."""
        return self._accepting

    def close(self) -> None:
        """Wait for a mask still being computed (the request ended before using it)."""
        if self._next is not None:
            self._next.result()
            self._next = None

"""Plain in-memory generation (no offloading): chat prompt -> streamed reply."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.config import SamplingParams
from backend.errors import BevyError, ContextTooLong
from backend.models.loader import LoadedModel
from backend.models.transformer import GetExpert, KVCache, SeqSlice
from backend.text.chat_template import DEFAULT_TEMPLATE, render_chat
from backend.text.grammar import Matcher
from backend.text.sampling import make_generator, sample
from backend.text.stops import StopMatcher


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length" (max tokens or context)
    prompt_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        return (
            (len(self.token_ids) - 1) / self.decode_s
            if self.decode_s > 0 and len(self.token_ids) > 1
            else 0.0
        )


def chat_prompt_ids(
    model: LoadedModel,
    messages: list[dict],
    tools: list[dict] | None = None,
    continue_final: bool = False,
) -> list[int]:
    """Render ``messages`` with the model's chat template and tokenize. With
    ``continue_final`` the last message is an assistant turn the reply goes on with: the
    prompt ends inside it, after its text, instead of opening a new turn."""
    tok = model.tokenizer
    if tok is None:
        raise BevyError(f"{model.path}: the model has no tokenizer")
    if continue_final:
        messages = _marked_final(messages)
    text = render_chat(
        tok.chat_template or DEFAULT_TEMPLATE,
        messages,
        tools=tools,
        add_generation_prompt=not continue_final,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
    )
    if continue_final:
        text = _open_final(text)
    ids = tok.encode(text, add_special=False)
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids.insert(0, tok.bos_id)
    return ids


# Written after a continued reply's text: the prompt is cut where the template put it, so
# whatever closes the turn goes and the reply's own text (trailing newline included)
# stays as it was. Not whitespace, so a template that trims the text keeps it.
_CONTINUE_MARK = "\u2063bevy-continues-here\u2063"


def _marked_final(messages: list[dict]) -> list[dict]:
    final = messages[-1] if messages else {}
    content = final.get("content")
    if final.get("role") != "assistant" or not isinstance(content, str) or not content.strip():
        raise BevyError("only a reply with text can be continued: the last message must be it")
    return [*messages[:-1], {**final, "content": content + _CONTINUE_MARK}]


def _open_final(text: str) -> str:
    """``text``, a chat rendered by ``_marked_final``'s messages, cut where the reply's
    text ends: the model writes on from there."""
    at = text.rfind(_CONTINUE_MARK)
    if at < 0:
        raise BevyError(
            "this model's chat template changes a reply's text, so the reply cannot be continued"
        )
    return text[:at]


OVERFLOW_POLICIES = ("error", "rolling", "truncate_middle")


def fit_chat(
    model: LoadedModel,
    messages: list[dict],
    tools: list[dict] | None,
    limit: int,
    policy: str = "error",
    continue_final: bool = False,
) -> tuple[list[int], int]:
    """The prompt ids of ``messages`` in at most ``limit`` tokens, and how many messages
    were left out for it. ``policy``: "error" leaves none out; "rolling" drops the oldest
    turns after the system prompt; "truncate_middle" keeps the first turn too and drops
    the ones after it. A turn goes whole (a user message and what answered it), so
    templates that require user/assistant order still get it; the last user message is
    never dropped (nor, with ``continue_final``, the reply being continued)."""
    if policy not in OVERFLOW_POLICIES:
        raise BevyError(f"context overflow policy must be one of {', '.join(OVERFLOW_POLICIES)}")
    tok = model.tokenizer
    if tok is None:
        raise BevyError(f"{model.path}: the model has no tokenizer")
    # Text longer than ``limit`` of the model's longest tokens cannot fit, tokenized or
    # not: such turns go (or the prompt is refused) before any tokenizing, which holds
    # the interpreter for seconds on megabytes of text.
    bound = limit * tok.max_token_chars
    given = len(messages)
    if policy == "error":  # judged against the whole context, as the tokens will be
        ctx = model.config.context_length
        if _chars(messages) > (ctx - 1) * tok.max_token_chars:
            raise ContextTooLong(
                f"the prompt has {_chars(messages)} characters: more than the model's "
                f"context of {ctx} tokens can hold whatever they are"
            )
    elif _chars(messages) > bound:
        messages = _drop_by_chars(messages, bound, policy == "truncate_middle")
    ids = chat_prompt_ids(model, messages, tools, continue_final)
    if len(ids) <= limit or policy == "error":
        return ids, given - len(messages)
    keep, rest = _split(messages, policy == "truncate_middle")
    # starts[k]: where ``rest`` begins with its k oldest turns dropped. Fewer turns never
    # take more tokens, so the fewest to drop is found by bisection: a few renders of
    # the chat instead of one per turn (7.4 s for a 620 KB chat of 72 turns, one by one).
    starts = [0]
    while cut := _droppable(rest[starts[-1] :]):
        starts.append(starts[-1] + cut)
    tried = {0: ids}

    def prompt(k: int) -> list[int]:
        if k not in tried:
            tried[k] = chat_prompt_ids(model, keep + rest[starts[k] :], tools, continue_final)
        return tried[k]

    lo, hi = 0, len(starts) - 1  # prompt(lo) does not fit; prompt(hi) is the shortest
    if len(prompt(hi)) > limit:
        lo = hi  # even the last turn alone is too long: the caller refuses it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(prompt(mid)) <= limit else (mid, hi)
    k = hi
    return prompt(k), given - len(keep) - (len(rest) - starts[k])


def prompt_room(model: LoadedModel, max_tokens: int) -> int:
    """The tokens a prompt may take: the context less room for the reply (up to a
    quarter of the context) and at least one generated token."""
    ctx = model.config.context_length
    return ctx - 1 - min(max_tokens, ctx // 4)


def _chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


def _split(messages: list[dict], keep_first: bool) -> tuple[list[dict], list[dict]]:
    """(what is always kept: the system prompt, and the first turn with ``keep_first``;
    the turns that may be dropped, oldest first)."""
    head = 0
    while head < len(messages) and messages[head].get("role") == "system":
        head += 1
    if keep_first and head < len(messages):
        head = _turn_end(messages, head)
    return list(messages[:head]), list(messages[head:])


def _droppable(rest: list[dict]) -> int:
    """How many messages the oldest turn of ``rest`` holds; 0 when only the last turn
    (with the last user message) is left, which is never dropped."""
    cut = _turn_end(rest, 0)
    if cut >= len(rest) or not any(m.get("role") == "user" for m in rest[cut:]):
        return 0
    return cut


def _drop_by_chars(messages: list[dict], bound: int, keep_first: bool) -> list[dict]:
    """``messages`` less their oldest turns (after the system prompt, and the first turn
    with ``keep_first``) until their text is under ``bound`` characters; ContextTooLong
    if the last turn alone is not."""
    keep, rest = _split(messages, keep_first)
    while _chars(keep + rest) > bound:
        cut = _droppable(rest)
        if not cut:
            raise ContextTooLong(
                f"the last message has {_chars(rest)} characters: more than the model's "
                "context can hold whatever they are"
            )
        rest = rest[cut:]
    return keep + rest


def _turn_end(messages: list[dict], start: int) -> int:
    """Where the turn beginning at ``start`` ends: the next user message after it."""
    i = start + 1
    while i < len(messages) and messages[i].get("role") != "user":
        i += 1
    return i


@torch.inference_mode()
def generate(
    model: LoadedModel,
    prompt_ids: list[int],
    params: SamplingParams,
    get_expert: GetExpert | None = None,
    on_text: Callable[[str], None] | None = None,
    before_step: Callable[[], None] = lambda: None,
) -> Generation:
    """Plain generation of one prompt, outside the engine; ``before_step`` is called
    before each forward pass (the prompt's, then each token's)."""
    cfg, t, tok = model.config, model.transformer, model.tokenizer
    if not prompt_ids:
        raise BevyError("the prompt is empty")
    if len(prompt_ids) >= cfg.context_length:
        raise BevyError(
            f"the prompt has {len(prompt_ids)} tokens; the model's context is {cfg.context_length}"
        )
    get_expert = get_expert or model.resident_experts(native=True).for_compute
    gen = make_generator(params)
    kv = KVCache(cfg.n_layers)
    decoder = tok.stream_decoder() if tok else None
    stops = StopMatcher(params.stop)
    eos = tok.eos_ids if tok else set()
    grammar = None
    if params.grammar is not None:
        if tok is None:
            raise BevyError("constrained decoding needs the model's tokenizer")
        grammar = Matcher(tok, cfg.vocab_size, params.grammar)
    out_ids: list[int] = []
    text = []
    before_step()
    t0 = time.perf_counter()
    logits = t.forward(
        torch.tensor(prompt_ids, device=t.device), [SeqSlice(kv, 0, len(prompt_ids))], get_expert
    )[0]
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    finish = "length"
    pos = len(prompt_ids)
    while True:
        allowed = None
        if grammar is not None and (allowed := grammar.allowed()) is None:
            raise BevyError(f"constrained decoding failed: {grammar.error}")
        nxt = sample(logits, params, gen, prompt_ids + out_ids, allowed)
        if nxt in eos and not params.ignore_eos:
            finish = "stop"
            break
        out_ids.append(nxt)
        if decoder is not None:
            piece = stops.feed(decoder.push(nxt))
            if piece:
                text.append(piece)
                if on_text:
                    on_text(piece)
            if stops.stopped:
                finish = "stop"
                break
        if grammar is not None and (not grammar.accept(nxt) or grammar.done):
            finish = "stop"  # the grammar admits nothing more
            break
        if len(out_ids) >= params.max_tokens or pos + 1 >= cfg.context_length:
            break
        before_step()
        logits = t.forward(
            torch.tensor([nxt], device=t.device), [SeqSlice(kv, pos, 1)], get_expert
        )[0]
        pos += 1
    if grammar is not None:
        grammar.close()
    if decoder is not None and not stops.stopped:
        tail = stops.feed(decoder.flush()) + stops.flush()
        if tail:
            text.append(tail)
            if on_text:
                on_text(tail)
    return Generation(
        "".join(text), out_ids, finish, len(prompt_ids), prefill_s, time.perf_counter() - t1
    )


@torch.inference_mode()
def greedy_reference(
    model: LoadedModel,
    prompts: list[list[int]],
    steps: int,
    get_expert: GetExpert | None = None,
    before_step: Callable[[], None] = lambda: None,
) -> list[list[int]]:
    """Plain in-memory greedy decoding of several prompts as one batch, ``steps`` tokens each
    (EOS ignored): the reference every engine policy must reproduce. ``before_step`` is
    called before each forward pass (the prompts', then each token's)."""
    t = model.transformer
    get_expert = get_expert or model.resident_experts(native=True).for_compute
    kvs = [KVCache(model.config.n_layers) for _ in prompts]
    seqs = [SeqSlice(kv, 0, len(p)) for kv, p in zip(kvs, prompts, strict=True)]
    before_step()
    logits = t.forward(
        torch.tensor([i for p in prompts for i in p], device=t.device), seqs, get_expert
    )
    out: list[list[int]] = [[] for _ in prompts]
    pos = [len(p) for p in prompts]
    for step in range(steps):
        nxt = logits.argmax(-1).tolist()
        for o, n in zip(out, nxt, strict=True):
            o.append(n)
        if step == steps - 1:
            break
        seqs = [SeqSlice(kv, p, 1) for kv, p in zip(kvs, pos, strict=True)]
        before_step()
        logits = t.forward(torch.tensor(nxt, device=t.device), seqs, get_expert)
        pos = [p + 1 for p in pos]
    return out

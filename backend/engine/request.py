"""One generation request and where it stands in the model.

Between jobs a running request sits *before the MoE of layer ``layer``*: its attention
and router for that layer are done, so the experts it needs (``needed``) are known.
A job runs those experts, then attention + router of the next layer (or, after the
last layer, the head, sampling, and attention + router of layer 0 for the next token).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the scheduler's tests run on requests without torch
    import torch

    from backend.config import SamplingParams
    from backend.models.transformer import KVCache
    from backend.text.grammar import Matcher
    from backend.text.stops import StopMatcher


class RequestStatus(enum.Enum):
    QUEUED = "queued"  # waiting for admission (KV budget, max concurrent)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    session: str = ""
    status: RequestStatus = RequestStatus.QUEUED
    arrival: int = 0  # admission order, for FIFO policies
    out_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    kv: KVCache | None = None
    generator: torch.Generator | None = None
    decoder: object | None = None  # tokenizer StreamDecoder
    stops: StopMatcher | None = None
    grammar: Matcher | None = None  # where the reply is constrained (``params.grammar``)
    computed_at: float = 0.0  # perf_counter when a compute job last ran for it
    dropped_messages: int = 0  # chat messages left out to fit the context
    # Position in the model (valid while RUNNING).
    layer: int = 0
    start: int = 0  # position of the first token in flight
    n: int = 0  # tokens in flight (prompt length in prefill, 1 in decode)
    h: torch.Tensor | None = None  # residual stream after attention(layer) [n, D]
    x: torch.Tensor | None = None  # MoE input [n, D]
    route_ids: torch.Tensor | None = None  # [n, K]
    route_w: torch.Tensor | None = None  # [n, K]
    route_list: list[list[int]] = field(default_factory=list)  # route_ids as lists
    needed: tuple[int, ...] = ()  # experts this layer's MoE uses (unique, sorted)
    claim: list[tuple[int, int]] = field(default_factory=list)  # keys this job has pinned
    claimed: bool = False  # holds pins on ``claim`` (resident or loading)
    done: set[int] = field(default_factory=set)  # experts of this layer already applied
    # Expert -> its weighted output [n, D], for a request whose experts are applied
    # over several runs (riding); summed in expert order once all are in.
    parts: dict[int, torch.Tensor] = field(default_factory=dict)
    # MoE output [n, D]: once all experts are applied; a prompt applying them over several
    # runs (split, chunked prefill) holds its sums so far here, added in expert order.
    acc: torch.Tensor | None = None
    ready_since: int = 0  # engine tick when the job became ready (FIFO compute order)
    # A long prompt read in slices of rows (chunked prefill, see ``Engine``): the rows of
    # this layer's job done so far, and what they produced for the next layer (h, x, ids,
    # weights per slice). ``emb``: the prompt's embeddings while its job is still
    # attention + router of layer 0 (``entering``).
    row: int = 0
    staged: list[tuple] = field(default_factory=list)
    emb: torch.Tensor | None = None
    finish_reason: str | None = None

    @property
    def entering(self) -> bool:
        return self.emb is not None

    @property
    def prefill(self) -> bool:
        return not self.out_ids

    def pending_keys(self, limit: int) -> list[tuple[int, int]]:
        """The next experts to claim: all remaining ones, or a chunk of ``limit`` if more."""
        return [(self.layer, e) for e in self.needed if e not in self.done][:limit]

    @property
    def completion_tokens(self) -> int:
        return len(self.out_ids)

    @property
    def budget_tokens(self) -> int:
        """Positions this request may occupy in its KV cache."""
        return len(self.prompt_ids) + self.params.max_tokens

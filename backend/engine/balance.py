"""When runahead pays: the ``bevy`` policy holds its requests together while compute, not
the link, is the bottleneck.

Runahead lets a request whose experts are all resident go on while another waits for a
fetch, so the link works while compute does. Its price is batching: requests spread over
the layers, each layer's experts are read (and multiplied) once per group instead of once
for everyone, and a job costs more compute. Where the link is the bottleneck that price
buys overlap. Where compute is (a busy machine leaving the engine one core of two, or a
cache so large that few experts are fetched) there is little to overlap and the price is
pure loss: with another process keeping a core busy, runahead computed half as long
again as lockstep for the same tokens and fell below sync (docs/performance.md).

``Balancer`` reads the last seconds' busy fractions of the two lanes and says whether the
requests should advance *together* (the group waits for every request at the lowest
layer, as lockstep does, and no waiting job applies its cached experts early; claims and
fetch order stay bevy's): when compute was busy nearly all the time while the link was
mostly idle. It lets them run ahead again once
the link is busy for a good share of the time, or compute idles for half of it: with
requests held together, either means compute is waiting on the link. The two thresholds are apart so that the mode does not flip
on noise. Under a CPU quota of at most 0.6 of a CPU (``CpuDomain.starved``) the requests
are always held: there the CPU time a token takes bounds decoding, whatever the lanes
show. Pure Python: tested without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

# Hold requests together when compute was busy at least this share of the window...
COMPUTE_BOUND = 0.85
# ... and the link at most this share; run ahead again when the link is busier than:
LINK_IDLE = 0.4
LINK_BUSY = 0.5
# ... or compute idles this share of the time (waiting on fetches: runahead's overlap pays).
COMPUTE_IDLE = 0.5
WINDOW_S = 2.0  # the lanes' history each decision reads
EVERY_S = 0.5  # how often it decides


@dataclass
class Balancer:
    starved: bool = False  # a CPU quota leaves the engine too little (``CpuDomain.starved``)
    together: bool = False
    switches: int = 0
    _last: float = float("-inf")
    _changed: float = float("-inf")

    def due(self, now: float) -> bool:
        return now - self._last >= EVERY_S

    def changed(self, now: float) -> None:
        """What runs changed at ``now`` (a prompt's prefill ended: long prompts read
        together hold their requests, and their decoding seldom should). The lanes'
        history before it says little about what follows, so the decisions after it read
        only the time since, at least ``EVERY_S`` of it: else decoding after a long
        prefill stays held for most of a window (docs/performance.md)."""
        self._changed = now

    def window_start(self, now: float) -> float:
        """Where the lanes' history that a decision at ``now`` reads begins."""
        return min(max(now - WINDOW_S, self._changed), now - EVERY_S)

    def update(self, now: float, link_busy: float, compute_busy: float, n_running: int) -> bool:
        """Decide from the window's busy fractions (0..1) and the requests running; returns
        whether they advance together. With fewer than two there is nothing to hold; in a
        ``starved`` engine two or more always are."""
        self._last = now
        if n_running < 2:
            want = False
        elif self.starved:
            want = True
        elif self.together:
            want = link_busy <= LINK_BUSY and compute_busy >= 1.0 - COMPUTE_IDLE
        else:
            want = compute_busy >= COMPUTE_BOUND and link_busy <= LINK_IDLE
        if want != self.together:
            self.together = want
            self.switches += 1
        return self.together

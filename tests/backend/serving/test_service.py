"""EngineService fans one engine's events out to many clients."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest

from backend.config import EngineConfig, SamplingParams
from backend.messages import ErrorEvent, Finished, MetricsSnapshot, Submit, TokenEvent
from backend.serving.service import EngineService, collect

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def service(tiny_chat_moe: Path):
    svc = EngineService.open(tiny_chat_moe, EngineConfig(cache="0.5", metrics_interval_s=0.05))
    yield svc
    svc.close()


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_each_client_gets_only_its_own_events(service: EngineService) -> None:
    results: dict[str, list] = {}

    def client(i: int) -> None:
        rid = service.new_id("t")
        evs = collect(service, Submit(rid, GREEDY, messages=_chat(f"question {i}")))
        assert all(e.request_id == rid for e in evs)
        results[rid] = evs

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 6
    for evs in results.values():
        fin = evs[-1]
        assert isinstance(fin, Finished) and fin.completion_tokens == 6
        assert "".join(e.text for e in evs if isinstance(e, TokenEvent)) == fin.text
    alone = collect(service, Submit("alone", GREEDY, messages=_chat("question 3")))
    # Same greedy tokens whether the request ran beside others or alone.
    ran_together = [
        e[-1] for e in results.values() if e[-1].prompt_tokens == alone[-1].prompt_tokens
    ]
    assert any(f.token_ids == alone[-1].token_ids for f in ran_together)
    assert service.active == 0


def test_abort_ends_with_finished_abort_and_releases_pins(service: EngineService) -> None:
    q: queue.Queue = queue.Queue()
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    service.submit(Submit("long", params, messages=_chat("hello")), q.put)
    assert isinstance(q.get(timeout=60), TokenEvent)
    service.abort("long")
    ev = q.get(timeout=60)
    while isinstance(ev, TokenEvent):
        ev = q.get(timeout=60)
    assert isinstance(ev, Finished) and ev.reason == "abort"
    snaps: queue.Queue = queue.Queue()
    unsubscribe = service.subscribe_metrics(snaps.put)
    snap = snaps.get(timeout=10)
    unsubscribe()
    assert isinstance(snap, MetricsSnapshot) and snap.cache_pinned == 0
    assert snap.n_layers == service.model.config.n_layers and snap.n_experts == 8


def test_bad_request_and_duplicate_id_fail_alone(service: EngineService) -> None:
    bad = collect(service, Submit("bad", GREEDY))  # neither messages nor prompt_ids
    assert isinstance(bad[-1], ErrorEvent) and "exactly one" in bad[-1].message
    q: queue.Queue = queue.Queue()
    slow = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    service.submit(Submit("dup", slow, messages=_chat("a")), q.put)
    second = collect(service, Submit("dup", GREEDY, messages=_chat("b")))
    assert isinstance(second[-1], ErrorEvent) and "in use" in second[-1].message
    service.abort("dup")
    while not isinstance(q.get(timeout=60), Finished):
        pass
    ok = collect(service, Submit("after", GREEDY, messages=_chat("still serving?")))
    assert isinstance(ok[-1], Finished)


def test_a_broken_listener_does_not_stop_the_others(service: EngineService) -> None:
    def broken(_ev) -> None:
        raise RuntimeError("client bug")

    service.submit(Submit("broken", GREEDY, messages=_chat("x")), broken)
    ok = collect(service, Submit("fine", GREEDY, messages=_chat("y")))
    assert isinstance(ok[-1], Finished) and ok[-1].completion_tokens == 6


class SlowPrompts:
    """chat_prompt as the service calls it, made slow the way a long chat's template and
    tokenizing are (the real function still makes the prompt); records the threads."""

    def __init__(self, delay_s: float) -> None:
        from backend.serving import service as service_module

        self.real, self.delay_s, self.threads = service_module.chat_prompt, delay_s, []
        self.started = threading.Event()

    def __call__(self, model, msg):
        self.threads.append(threading.current_thread().name)
        self.started.set()
        time.sleep(self.delay_s)
        return self.real(model, msg)


def test_a_slow_chat_prompt_does_not_stall_running_requests(
    service: EngineService, monkeypatch: pytest.MonkeyPatch
) -> None:
    running: queue.Queue = queue.Queue()
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    service.submit(Submit("runs", params, prompt_ids=[1, 2, 3]), running.put)
    assert isinstance(running.get(timeout=60), TokenEvent)
    slow = SlowPrompts(1.5)
    monkeypatch.setattr("backend.serving.service.chat_prompt", slow)
    waiting: queue.Queue = queue.Queue()
    service.submit(Submit("slow", GREEDY, messages=_chat("a long chat")), waiting.put)
    assert slow.started.wait(10)
    while not running.empty():
        running.get_nowait()
    time.sleep(1.0)  # inside the slow prompt's 1.5 s
    assert running.qsize() >= 3  # the engine kept decoding meanwhile
    assert isinstance(collect_rest(waiting)[-1], Finished)
    assert slow.threads == ["bevy-prompts"]
    service.abort("runs")
    assert collect_rest(running)[-1].reason == "abort"


def test_abort_while_the_prompt_is_made_ends_the_request(
    service: EngineService, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = SlowPrompts(0.5)
    monkeypatch.setattr("backend.serving.service.chat_prompt", slow)
    q: queue.Queue = queue.Queue()
    long = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    service.submit(Submit("early", long, messages=_chat("hi")), q.put)
    assert slow.started.wait(10)
    service.abort("early")
    end = collect_rest(q)[-1]
    assert isinstance(end, Finished) and end.reason == "abort" and end.completion_tokens < 50
    assert service.active == 0


def test_a_chat_that_cannot_fit_fails_alone_and_rolling_reports_what_it_dropped(
    service: EngineService,
) -> None:
    ctx = service.model.config.context_length
    turns = []
    for i in range(12):  # each user turn alone fits; all of them do not
        turns += [
            {"role": "user", "content": f"turn {i} " + "word " * (ctx // 8)},
            {"role": "assistant", "content": "ok"},
        ]
    turns.append({"role": "user", "content": "last"})
    refused = collect(service, Submit("toolong", GREEDY, messages=turns))
    assert isinstance(refused[-1], ErrorEvent) and "context" in refused[-1].message
    rolled = collect(service, Submit("rolled", GREEDY, messages=turns, overflow="rolling"))
    assert isinstance(rolled[-1], Finished) and rolled[-1].dropped_messages > 0
    assert rolled[-1].prompt_tokens < ctx
    assert service.active == 0


def collect_rest(q: queue.Queue, timeout: float = 120.0) -> list:
    """A request's events up to its terminal one."""
    out = []
    while not out or not isinstance(out[-1], Finished | ErrorEvent):
        out.append(q.get(timeout=timeout))
    return out


def test_a_chat_stopped_before_its_prompt_is_made_is_not_made(
    service: EngineService, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = SlowPrompts(0.6)
    monkeypatch.setattr("backend.serving.service.chat_prompt", slow)
    first: queue.Queue = queue.Queue()
    second: queue.Queue = queue.Queue()
    service.submit(Submit("made", GREEDY, messages=_chat("first")), first.put)
    assert slow.started.wait(10)
    service.submit(Submit("skipped", GREEDY, messages=_chat("second")), second.put)
    service.abort("skipped")  # still waiting behind the first one's prompt
    end = collect_rest(second)[-1]
    assert isinstance(end, Finished) and end.reason == "abort" and end.completion_tokens == 0
    assert isinstance(collect_rest(first)[-1], Finished)
    assert len(slow.threads) == 1  # only the first chat's prompt was made
    assert service.active == 0

"""The load runner's order, against a real uvicorn server on loopback that records when each request came
and when its stream ended: requests go in the order given, at most C in flight, and a conversation's turn
only once its previous turn has been answered."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from serve.serve_helpers import running_server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from linnet.bench.serving_client import run_load


class Recorder:
    """A streaming /v1/completions whose prompt is [request number, milliseconds to take]; it records each
    request's start and end (its last chunk written) on one clock."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, float]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def completions(request: Request) -> StreamingResponse:
            number, delay_ms = (await request.json())["prompt"]
            self.note("start", number, +1)

            async def stream():
                await asyncio.sleep(delay_ms / 1000)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x', 'finish_reason': None}]})}\n\n"
                usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
                self.note("end", number, -1)
                last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
                yield f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    def note(self, what: str, number: int, change: int) -> None:
        with self.lock:
            self.events.append((what, number, time.monotonic()))
            self.in_flight += change
            self.most_in_flight = max(self.most_in_flight, self.in_flight)

    def at(self, what: str) -> dict[int, float]:
        return {number: t for kind, number, t in self.events if kind == what}


def test_a_turn_waits_for_its_conversations_previous_turn_and_the_order_is_kept():
    recorder = Recorder()
    # conversation A's first turn is slow; B's is fast, but B's second turn comes after A's in the order
    #               A1          B1         A2        B2        C1
    prompts = [[0, 400], [1, 10], [2, 10], [3, 10], [4, 10]]
    follows = [None, None, 0, 1, None]
    with running_server(recorder.app()) as url:
        load = run_load(url, "m", prompts, 1, 2, {}, follows=follows)
    assert [t.completion_tokens for t in load.timings] == [1] * 5
    starts, ends = recorder.at("start"), recorder.at("end")
    assert starts[1] < ends[1] < ends[0]  # A1 and B1 at once
    assert starts[2] > ends[0] and starts[3] > ends[1]  # a turn after its conversation's previous one
    assert starts[3] > ends[0]  # B's second turn waited behind A's, as the order says, not only for B1
    assert starts[4] > min(ends[2], ends[3])  # C1 behind both, for a slot
    assert recorder.most_in_flight == 2  # two slots, never three


def test_without_follows_the_requests_only_wait_for_a_slot():
    recorder = Recorder()
    with running_server(recorder.app()) as url:
        run_load(url, "m", [[0, 300], [1, 10], [2, 10]], 1, 2, {})
    starts, ends = recorder.at("start"), recorder.at("end")
    assert starts[2] < ends[0]  # the third took the second's slot while the first still ran
    assert recorder.most_in_flight == 2


@pytest.mark.parametrize("follows", [[None, 1], [None], [0, None]])
def test_follows_must_name_an_earlier_request(follows):
    with pytest.raises(ValueError, match="follows needs one entry a prompt"):
        run_load("http://127.0.0.1:9", "m", [[0, 1], [1, 1]], 1, 2, {}, follows=follows)

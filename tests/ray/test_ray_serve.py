"""Linnet on Ray Serve: a local Ray cluster of two nodes (``ray.cluster_utils.Cluster``), two replicas of a
tiny checkpoint on the reference backend, one on each node, answering the ``openai`` client as ``linnet
serve`` does; requests sharing a prefix land on the replica holding it; a killed replica is replaced
and no request hangs."""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'linnet[ray]'")

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray._common.utils import import_attr  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))  # linnet serve's own test helpers
from serve_helpers import CASE, running_server  # noqa: E402

from linnet.ray.deployment import build, serve_options  # noqa: E402
from linnet.ray.replica import load_engine  # noqa: E402
from linnet.serve.app import create_app  # noqa: E402

pytestmark = pytest.mark.slow
OBJECT_STORE = 200 * 2**20  # the machine is shared: Ray's default takes 30% of its memory
WORDS = "The quick brown fox jumps over the lazy dog. "
SETTINGS = {"backend": "reference:numpy", "rows": 2, "positions": 256, "threads": 1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(checkpoint_dir) -> str:
    return str(checkpoint_dir(CASE))


@pytest.fixture(scope="module")
def endpoint(model_path) -> Iterator[str]:
    """Two nodes of two CPUs each: two replicas of one CPU each, and room for the autoscaling test's two."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": OBJECT_STORE})
    cluster.add_node(num_cpus=2, object_store_memory=OBJECT_STORE)
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        # as `serve run linnet.ray:app model=... replicas=2 ...` builds it: every argument a string
        arguments = {"model": model_path, "replicas": "2", **{k: str(v) for k, v in SETTINGS.items()}}
        application = call_user_app_builder_with_args_if_necessary(import_attr("linnet.ray:app"), arguments)
        serve.run(application, name="linnet", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:  # the apps' replicas end with Ray
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def plain(model_path) -> Iterator[str]:
    """``linnet serve``'s engine and app for the same options, in this process."""
    engine = load_engine(serve_options({"model": model_path, **SETTINGS}))
    with running_server(create_app(engine, model_path)) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)


def completion(url: str, model: str, prompt: str, max_tokens: int = 6) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_greedy_answers_equal_linnet_serves_streamed_or_not(endpoint, plain, model_path):
    prompts = [WORDS, "Héllo wörld, ünïcode", "over the lazy dog. The quick"]
    for url in (endpoint, plain):
        assert client(url).models.list().data[0].id == model_path
    got, want = ([client(url).completions.create(model=model_path, prompt=p, max_tokens=8, temperature=0).choices[0]
                  .text for p in prompts] for url in (endpoint, plain))
    assert got == want
    messages = [{"role": "user", "content": "The lazy dog?"}]

    def chat(url: str) -> tuple[str, int | None]:
        text, usage = [], None
        for chunk in client(url).chat.completions.create(model=model_path, messages=messages, max_tokens=8,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}):
            text += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return "".join(text), usage

    assert chat(endpoint) == chat(plain)
    with pytest.raises(openai.NotFoundError):  # the replicas' own errors, relayed
        client(endpoint).completions.create(model="other", prompt="x", max_tokens=1)
    bad = httpx.post(endpoint + "/v1/completions", json={"model": model_path, "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and "max_tokens" in bad.text


def test_one_replica_answers_as_linnet_serve_without_the_ingress(endpoint, plain, model_path):
    """One replica, nothing to route: Ray's proxy hands it the requests itself, here under a route prefix."""
    arguments = {"model": model_path, **{k: str(v) for k, v in SETTINGS.items()}}
    serve.run(build(serve_options(arguments)), name="one", route_prefix="/one")
    try:
        url = endpoint + "/one"
        prompt = "over the lazy dog. The quick"
        got, want = (client(u).completions.create(model=model_path, prompt=prompt, max_tokens=8, temperature=0)
                     .choices[0].text for u in (url, plain))
        assert got == want
        streamed = "".join(c.choices[0].text for c in client(url).completions.create(
            model=model_path, prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
        assert streamed == want
        answer = completion(url, model_path, prompt)
        assert answer.status_code == 200 and answer.headers["x-linnet-replica"]
    finally:
        serve.delete("one")


def test_both_replicas_take_requests(endpoint, model_path):
    async def burst() -> set[str]:
        async with httpx.AsyncClient(timeout=60) as http:
            answers = await asyncio.gather(*(http.post(endpoint + "/v1/completions", json={
                "model": model_path, "prompt": f"fox {i}", "max_tokens": 24, "ignore_eos": True})
                for i in range(8)))
        assert all(a.status_code == 200 for a in answers)
        return {a.headers["x-linnet-replica"] for a in answers}

    assert len(asyncio.run(burst())) == 2


def test_a_shared_prefix_lands_on_the_replica_holding_it(endpoint, model_path):
    for n in range(4):  # four conversations, each a long opening and two turns that extend it
        opening = f"{n} " + WORDS * 3
        first = completion(endpoint, model_path, opening)
        where = first.headers["x-linnet-replica"]
        so_far = opening + first.json()["choices"][0]["text"]
        for turn in range(2):
            so_far += f" {WORDS[:20]} {turn}"
            answer = completion(endpoint, model_path, so_far)
            assert answer.headers["x-linnet-replica"] == where
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            so_far += answer.json()["choices"][0]["text"]


def test_a_killed_replica_ends_its_stream_with_an_error_and_is_replaced(endpoint, model_path):
    body = {"model": model_path, "prompt": WORDS, "max_tokens": 200, "ignore_eos": True, "stream": True}
    lines = []
    started = time.monotonic()
    with httpx.stream("POST", endpoint + "/v1/completions", json=body, timeout=60) as stream:
        killed = stream.headers["x-linnet-replica"]
        for line in filter(None, stream.iter_lines()):
            lines.append(line)
            if len(lines) == 3:
                ray.kill(replica_actor(killed))
    assert time.monotonic() - started < 60
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))
    assert error["error"]["type"] == "server_error" and "failed" in error["error"]["message"]
    assert len(lines) < 200  # ended early, not a whole answer

    for i in range(4):  # the survivor answers at once; none goes to the dead replica
        answer = completion(endpoint, model_path, f"dog {i}")
        assert answer.status_code == 200 and answer.headers["x-linnet-replica"] != killed
    # a replacement: two live replica actors again, the killed one not among them
    wait_for(lambda: len(live_replicas("linnet") - {killed}) == 2, "Ray did not replace the killed replica")
    wait_for(lambda: running_replicas() == 2, "the replacement did not come up")
    serving = {completion(endpoint, model_path, f"fox {i}").headers["x-linnet-replica"] for i in range(8)}
    assert killed not in serving


def live_replicas(app: str) -> set[str]:
    prefix = f"SERVE_REPLICA::{app}#LinnetReplica#"
    return {a["name"].removeprefix(prefix) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def replica_actor(unique_id: str) -> ray.actor.ActorHandle:
    return ray.get_actor(f"SERVE_REPLICA::linnet#LinnetReplica#{unique_id}", namespace="serve")


def running_replicas(app: str = "linnet") -> int:
    status = serve.status().applications[app].deployments["LinnetReplica"]
    return status.replica_states.get("RUNNING", 0)


@pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")
def test_autoscaling_from_one_replica_to_two_under_load_and_back(endpoint, model_path):
    """Another application on the same cluster, under a route prefix: one to two replicas on queue length."""
    args = serve_options({"model": model_path, **SETTINGS, "min_replicas": 1, "max_replicas": 2})
    # a short look-back (Ray warns it is under the metrics interval it is deprecating) halves this test's time
    fast = {"upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_period_s": 2}
    serve.run(build(args, autoscaling=fast), name="scaling", route_prefix="/scaling")
    url = endpoint + "/scaling"
    assert running_replicas("scaling") == 1
    assert completion(url, model_path, "fox").status_code == 200  # the prefix is the ingress's, not the app's

    stop = threading.Event()

    def load() -> None:  # five streams at a time on rows=2: past the target of two a replica
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                http.post(url + "/v1/completions", json={"model": model_path, "prompt": WORDS, "max_tokens": 100,
                                                         "ignore_eos": True})

    workers = [threading.Thread(target=load, daemon=True) for _ in range(5)]
    for worker in workers:
        worker.start()
    try:
        wait_for(lambda: running_replicas("scaling") == 2, "Ray did not add a replica under load")
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    wait_for(lambda: running_replicas("scaling") == 1, "Ray did not remove the replica once idle")
    serve.delete("scaling")


def test_round_robin_routing_sends_one_prompt_to_both_replicas_in_turn(endpoint, model_path):
    """Another application on the same cluster, with ``router=round-robin``: the same prompt again and again,
    which the prefix-aware router keeps on one replica, goes to the two replicas in turn."""
    args = serve_options({"model": model_path, **SETTINGS, "replicas": 2, "router": "round-robin"})
    serve.run(build(args), name="robin", route_prefix="/robin")
    try:
        served = [completion(endpoint + "/robin", model_path, WORDS * 3).headers["x-linnet-replica"]
                  for _ in range(8)]
        # in turn: strictly alternating, unless Ray's probe of a replica's queue timed out on a busy machine
        # and the request took the next turn
        assert len(set(served)) == 2 and min(served.count(r) for r in set(served)) >= 3, served
    finally:
        serve.delete("robin")


def wait_for(condition: Callable[[], bool], failure: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.5)

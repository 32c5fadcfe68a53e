"""The replica deployment's request routers without a Ray cluster: round-robin's order, both Ray Serve
adapters' choices on real ``PendingRequest``s (the prompt ignored by one, followed by the other), and the
``--router`` flag of ``linnet serve`` and of the application builder."""
from __future__ import annotations

import asyncio
import re
import sys
from types import SimpleNamespace

import pytest

from linnet.cli import main
from linnet.errors import LinnetError
from linnet.ray.router import round_robin

SYSTEM = "You are a helpful assistant who answers in one short sentence.  " * 4  # 4 blocks of 64 characters


def test_round_robin_starts_each_turn_at_the_next_replica_and_wraps_around():
    replicas = ["r0", "r1", "r2"]
    assert [round_robin(replicas, turn) for turn in range(4)] == [
        ["r0", "r1", "r2"], ["r1", "r2", "r0"], ["r2", "r0", "r1"], ["r0", "r1", "r2"]]
    assert round_robin(replicas, 3 * 10**9 + 1) == ["r1", "r2", "r0"]
    assert round_robin([], 5) == []


@pytest.fixture
def ray_routing():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'linnet[ray]'")
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    from linnet.ray import request_router
    from linnet.ray.replica import Forwarded

    deployment = DeploymentID(name="LinnetReplica", app_name="linnet")

    def make_router(cls: type, **kwargs):
        router = cls(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN,
                     use_replica_queue_len_cache=True)  # as Ray builds its routers
        router.initialize_state(**kwargs)
        return router

    def replicas(n: int) -> list[SimpleNamespace]:  # what the routers read of Ray's RunningReplica
        return [SimpleNamespace(replica_id=ReplicaID(f"r{i}", deployment)) for i in range(n)]

    def pending(prompt: str, number: int) -> PendingRequest:
        forwarded = Forwarded("POST", "/v1/completions", b"", [], b"{}", prompt)
        return PendingRequest([forwarded], {}, RequestMetadata(f"request {number}", f"internal {number}"))

    return SimpleNamespace(module=request_router, make_router=make_router, replicas=replicas, pending=pending)


def names(ranks) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_round_robin_router_takes_the_replicas_in_turn_whatever_the_prompt(ray_routing):
    router = ray_routing.make_router(ray_routing.module.RoundRobinRouter)
    replicas = ray_routing.replicas(3)

    async def route(n: int):
        chosen = []
        for i in range(n):
            request = ray_routing.pending(SYSTEM + "the same question", i)
            ranks = await router.choose_replicas(replicas, request)
            assert request.routing_context.should_backoff  # all full: Ray waits before asking again
            chosen.append(names(ranks))
        return chosen

    chosen = asyncio.run(route(4))
    # one replica a rank, so a full one's request goes to the next in turn; each turn starts one further on
    assert chosen == [[["r0"], ["r1"], ["r2"]], [["r1"], ["r2"], ["r0"]], [["r2"], ["r0"], ["r1"]],
                      [["r0"], ["r1"], ["r2"]]]


def test_the_prefix_aware_router_keeps_a_prompt_on_the_replica_it_sent_it_to(ray_routing):
    """The same requests as above, through the prefix-aware router: all on one replica, until it is busier
    than the busy margin allows."""
    router = ray_routing.make_router(ray_routing.module.PrefixAwareRouter, busy_margin=2)
    replicas = ray_routing.replicas(3)
    for replica in replicas:
        router.replica_queue_len_cache.update(replica.replica_id, 0)

    async def route(n: int) -> list[str]:
        firsts = []
        for i in range(n):
            request = ray_routing.pending(SYSTEM + "the same question", i)
            ranks = await router.choose_replicas(replicas, request)
            assert request.routing_context.should_backoff
            first = ranks[0][0].replica_id
            assert sorted(r for rank in names(ranks) for r in rank) == ["r0", "r1", "r2"]
            router.on_request_routed(request, first, None)
            router.on_send_request(first)  # as Ray counts it in the replica's queue
            firsts.append(first.unique_id)
        return firsts

    firsts = asyncio.run(route(4))
    assert len(set(firsts[:3])) == 1  # loads 0, 1, 2 against 0: within the margin of 2
    assert firsts[3] != firsts[0]  # a queue of 3 against 0: passed over


def test_the_router_flag_picks_a_router_and_refuses_an_unknown_one_by_name(capsys, monkeypatch):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'linnet[ray]'")
    from linnet.ray.deployment import DEFAULT_ROUTER, ROUTERS, router_config, serve_options

    robin = serve_options({"model": "m", "replicas": 2, "router": "round-robin"})
    config = router_config(robin)
    assert config.request_router_class.endswith(".RoundRobinRouter") and config.request_router_kwargs == {}
    prefix = serve_options({"model": "m", "replicas": 2, "rows": 4, "positions": 256})
    assert prefix.router is None and DEFAULT_ROUTER == "prefix"
    config = router_config(prefix)
    assert config.request_router_class.endswith(".PrefixAwareRouter")
    assert config.request_router_kwargs == {"record_blocks": 4 * 256 * 4 // 64}  # the replica's rows, as blocks
    with pytest.raises(LinnetError, match=r"linnet.ray:app: argument --router: invalid choice: 'random'"):
        serve_options({"model": "m", "router": "random"})

    with pytest.raises(SystemExit) as exited:
        main(["serve", "no-such-model", "--replicas", "2", "--router", "random"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    choices = re.search(r"--router: invalid choice: 'random' \(choose from (.*?)\)", err)
    assert choices and choices.group(1).replace("'", "").split(", ") == list(ROUTERS), err  # the deployment's

    # --router alone is a Ray flag, as --ray-address is: without Ray, the extra is named
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["serve", "no-such-model", "--router", "round-robin"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'linnet[ray]'" in err and "--router" in err and "Traceback" not in err

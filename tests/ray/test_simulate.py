"""The routing simulation: a small trace, every policy serving every request, and prefix-aware routing
recomputing fewer prompt tokens than round-robin and least-loaded."""
from __future__ import annotations

import pytest

from linnet.ray import simulate as sim


def test_a_conversations_turns_extend_each_other():
    [conversation] = sim.make_trace(1, 1.0, sim.TraceShape(turns=(3, 3)), seed=1)
    first, second, third = conversation.turns
    assert second.prompt[:len(first.held)] == first.held  # the next turn starts with all the last one wrote
    assert sim.cached_tokens(first, second) == len(first.held)
    assert sim.cached_tokens(second, second) == len(second.prompt) - 1  # the prompt's last token is always read
    assert sim.cached_tokens(third, first) == len(first.prompt) - 1


def test_prefix_aware_routing_recomputes_fewer_prompt_tokens():
    results = sim.run([4], per_replica=30, rows=4, load=0.7, shape=sim.TraceShape(), costs=sim.Costs(), seed=3)
    by_policy = {r.policy: r for r in results}
    assert set(by_policy) == set(sim.POLICIES)
    counts = {(r.requests, r.prompt_tokens) for r in results}
    assert len(counts) == 1 and results[0].requests >= 4 * 30 * 2  # every policy served the same whole trace
    aware, robin, least = (by_policy[p] for p in ("prefix-aware", "round-robin", "least-loaded"))
    assert aware.recomputed < 0.9 * robin.recomputed
    assert aware.recomputed < 0.9 * least.recomputed
    assert all(0 <= r.hit_rate < 1 and len(r.ttft) == r.requests for r in results)
    table = sim.table(results)
    assert table.count("\n") == 2 + len(results) - 1 and "| 4 | prefix-aware |" in table


def test_the_command_prints_the_table(capsys):
    assert sim.main(["--replicas", "2", "--conversations-per-replica", "5", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | round-robin |" in out and "1.00x" in out
    with pytest.raises(SystemExit):
        sim.main(["--rows", "0"])

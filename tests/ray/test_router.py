"""The prefix-aware routing decision, without Ray: blocks, records, the choice and the prompt's text."""
from __future__ import annotations

import pytest

from linnet.errors import LinnetError
from linnet.ray.router import PrefixRecord, choose, prefix_blocks, prompt_text

SYSTEM = "You are a helpful assistant who answers in one short sentence.  " * 4  # 256 characters: 4 blocks


def test_blocks_are_chained_whole_blocks_and_the_same_in_every_process():
    assert len(SYSTEM) == 256
    a = prefix_blocks(SYSTEM + "What is the capital of France?", block_chars=64)
    b = prefix_blocks(SYSTEM + "Name a prime number larger than ten.", block_chars=64)
    assert len(a) == 4 and len(b) == 4  # the tails (under a block) are left out
    assert a == b
    c = prefix_blocks("x" + SYSTEM[1:], block_chars=64)
    assert all(x != y for x, y in zip(a, c))  # a change in block 0 changes every block after it
    assert prefix_blocks(SYSTEM, block_chars=64, max_blocks=2) == a[:2]
    assert prefix_blocks("short", block_chars=64) == []
    assert a[0].hex() == prefix_blocks(SYSTEM[:64], block_chars=64)[0].hex() == "c0b65cad86f328ba"  # blake2b, fixed
    with pytest.raises(LinnetError, match="block_chars"):
        prefix_blocks(SYSTEM, block_chars=0)


def test_a_record_matches_leading_blocks_and_evicts_deepest_first():
    conversation = prefix_blocks(SYSTEM * 3)  # 12 blocks
    record = PrefixRecord(capacity=10)
    record.add(conversation[:8])
    assert record.matched(conversation) == 8
    assert record.matched(conversation[:3]) == 3
    assert record.matched(prefix_blocks("y" * 640)) == 0
    record.add(prefix_blocks("z" * 256))  # 4 more: 12 > 10, so the first prompt's two deepest go
    assert len(record) == 10
    assert record.matched(conversation) == 6
    with pytest.raises(LinnetError, match="at least 1"):
        PrefixRecord(0)


def test_the_replica_holding_the_longest_prefix_is_first():
    first_turn = prefix_blocks(SYSTEM + "a" * 128)
    second_turn = prefix_blocks(SYSTEM + "a" * 128 + "b" * 128)
    records = {"r0": PrefixRecord(), "r1": PrefixRecord(), "r2": PrefixRecord()}
    records["r0"].add(first_turn[:4])  # the system prompt only
    records["r1"].add(first_turn)  # the conversation so far
    loads = {"r0": 0, "r1": 2, "r2": 0}
    assert choose(second_turn, loads, records) == ["r1", "r0", "r2"]


def test_a_busy_holder_is_passed_over_for_the_least_loaded():
    blocks = prefix_blocks(SYSTEM)
    records = {"r0": PrefixRecord(), "r1": PrefixRecord()}
    records["r0"].add(blocks)
    assert choose(blocks, {"r0": 4, "r1": 0}, records, busy_margin=4)[0] == "r0"
    assert choose(blocks, {"r0": 5, "r1": 0}, records, busy_margin=4)[0] == "r1"


def test_with_no_match_the_least_loaded_go_first_and_a_prefix_gathers_on_one():
    loads = {f"r{i}": 1 for i in range(8)} | {"r8": 0}
    assert choose(prefix_blocks(SYSTEM), loads, {})[0] == "r8"
    loads["r8"] = 1
    # ties by rendezvous hashing on the first block: one replica for a prefix, whoever routes it
    picks = {choose(prefix_blocks(SYSTEM + f"question {i}" * 20), loads, {})[0] for i in range(20)}
    assert len(picks) == 1
    others = {choose(prefix_blocks(f"{i} other system prompt" * 20), loads, {})[0] for i in range(40)}
    assert len(others) > 3  # different prefixes spread
    short = {choose([], loads, {})[0] for _ in range(60)}  # no block at all: spread at random
    assert len(short) > 3
    assert choose([], {}, {}) == []


def test_the_prompt_text_of_completions_and_chats():
    assert prompt_text({"model": "m", "prompt": "Once upon"}) == "Once upon"
    assert prompt_text({"prompt": ["Once upon"]}) == "Once upon"
    assert prompt_text({"prompt": [12, 7, 300]}) == "12,7,300,"
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]}
    assert prompt_text(chat) == "<system>Be brief.<user>Hi!"
    # a growing conversation's text starts with its earlier turns' text: the router sees the prefix
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "Hello."}]}
    assert prompt_text(longer).startswith(prompt_text(chat))
    for nothing in ({}, [], "text", {"prompt": 3}, {"prompt": ["a", "b"]}, {"messages": "no"}, {"prompt": [1, "x"]}):
        assert prompt_text(nothing) == ""

"""Prefix-aware routing, as pure functions: which replica should take a request, given the blocks of its
prompt, each replica's queue length, and what each replica was sent lately.

A replica's engine reuses the longest prefix a free cache row still holds (``linnet.serve.engine``), so a
request is cheapest on the replica that served its conversation's earlier turns (or the same system
prompt). The router cannot see inside the replicas' caches; it remembers, per replica, the hashes of the
prompt blocks it sent there (a bounded, least-recently-used record), as vLLM's and Ray's prefix routers do.
Hashes are chained (block i's hash covers blocks 0..i), so a record holding block i's hash held the whole
prefix up to it, and a match is a count of leading blocks.

``round_robin`` is the baseline it is measured against: the replicas in turn, whatever the prompt.

The Ray Serve adapters (``linnet.ray.request_router``) feed these from Ray's queue-length cache; the
simulation (``linnet.ray.simulate``) feeds them from its own model of replicas. Nothing here imports Ray.
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

from linnet.errors import LinnetError

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

BLOCK_CHARS = 64  # about 16 tokens of English: short enough that a shared system prompt spans several blocks
MAX_BLOCKS = 256  # 16k characters: past that, a longer match cannot change which replica is best
RECORD_BLOCKS = 20_000  # blocks remembered per replica: 1.3M characters, a few hundred conversations' prompts
BUSY_MARGIN = 4  # a replica with the prefix is passed over once its queue is this much longer than the shortest


def prefix_blocks(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> list[bytes]:
    """The chained hashes of ``text``'s whole blocks of ``block_chars`` characters (at most ``max_blocks``).
    A tail shorter than a block is left out: it is the part least likely to be shared. blake2b rather than
    ``hash()``: the same text hashes alike in every process (ingress replicas, the simulation)."""
    if block_chars < 1:
        raise LinnetError(f"block_chars must be at least 1, not {block_chars}")
    blocks: list[bytes] = []
    previous = b""
    for start in range(0, min(len(text) // block_chars, max_blocks) * block_chars, block_chars):
        previous = hashlib.blake2b(previous + text[start:start + block_chars].encode("utf-8", "surrogatepass"),
                                   digest_size=8).digest()
        blocks.append(previous)
    return blocks


class PrefixRecord:
    """The prefix blocks one replica was sent lately, least recently used first out past ``capacity``."""

    def __init__(self, capacity: int = RECORD_BLOCKS):
        if capacity < 1:
            raise LinnetError(f"a prefix record holds at least 1 block, not {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, blocks: Sequence[bytes]) -> int:
        """How many of ``blocks``' leading blocks this replica was sent (a binary search: chained hashes
        make a held block imply every block before it, up to evictions, which go oldest first)."""
        low, high = 0, len(blocks)
        while low < high:
            middle = (low + high + 1) // 2
            if blocks[middle - 1] in self._blocks:
                low = middle
            else:
                high = middle - 1
        return low

    def add(self, blocks: Sequence[bytes]) -> None:
        """Remember ``blocks`` (a prompt's, in order) as the most recent; the first block most recent of all,
        so that eviction takes a prefix's deepest blocks first and what stays is always whole prefixes."""
        for block in reversed(blocks):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


def choose(blocks: Sequence[bytes], loads: Mapping[K, int], records: Mapping[K, PrefixRecord],
           busy_margin: int = BUSY_MARGIN) -> list[K]:
    """The replicas of ``loads`` (id -> requests queued or running), best first.

    First the replica holding the longest prefix of ``blocks``, unless its queue is more than
    ``busy_margin`` longer than the shortest (then the prefix costs more in waiting than it saves); then
    the rest, least loaded first. Among equals the tie goes by rendezvous hashing on the first block, so
    the first turns of conversations sharing a system prompt gather on one replica, and two routers that
    do not share records (two ingress replicas) agree.
    """
    if not loads:
        return []
    least = min(loads.values())
    # a prompt shorter than a block has nothing to gather for: its ties go at random, spreading such requests
    first = blocks[0] if blocks else random.getrandbits(64).to_bytes(8, "little")

    def tie(replica: K) -> bytes:
        return hashlib.blake2b(first + repr(replica).encode(), digest_size=8).digest()

    def match(replica: K) -> int:
        record = records.get(replica)
        return record.matched(blocks) if record is not None and loads[replica] <= least + busy_margin else 0

    matches = {replica: match(replica) for replica in loads}
    return sorted(loads, key=lambda r: (-matches[r], loads[r], tie(r)))


def round_robin(replicas: Sequence[T], turn: int) -> list[T]:
    """``replicas`` in the order turn ``turn`` tries them: from the one at ``turn`` (modulo their count)
    on, wrapping around, so that successive turns start at successive replicas."""
    if not replicas:
        return []
    start = turn % len(replicas)
    return [*replicas[start:], *replicas[:start]]


def prompt_text(body: Any) -> str:
    """The text a request's prompt starts with, from its parsed JSON body: a completion's prompt (a
    string, one string in a list, or token ids, written out as numbers), or a chat's messages, each role
    and content in order (what the chat template will lay out in the same order). Empty when there is
    none: the request is routed by load alone, and the replica answers it (or refuses it by name)."""
    if not isinstance(body, dict):
        return ""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            return ""
        return "".join(f"<{m.get('role')}>{_content_text(m.get('content'))}" for m in messages
                       if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "".join(f"{t}," for t in prompt)
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI's content parts: the text ones, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""

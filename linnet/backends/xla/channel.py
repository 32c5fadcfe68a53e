"""Process 0's messages to the other processes of a ``--num-processes`` job (``linnet.serve.lockstep``),
through the key-value store of JAX's coordinator, which every joined process already holds a connection to.

Chosen over ``jax.experimental.multihost_utils.broadcast_one_to_all``: that is itself an SPMD program (a sum
over every device, compiled for each payload shape) whose wait has no deadline. The store takes bytes of any
length, runs no device work between the steps, and its wait takes a timeout, so a follower tells an idle
process 0 (no requests: it waits on) from a lost one (the store's connection fails).

Message n is the key ``linnet/lockstep/{n // BLOCK}/{n % BLOCK}``; the last follower through a block
deletes it, so the store holds a block or two, however long the server runs.
"""
from __future__ import annotations

import time
from typing import Any

from linnet.errors import LinnetError

PREFIX = "linnet/lockstep"
BLOCK = 64  # messages a follower reads between two of its writes to the store
LOST_GRACE_S = 5.0


class CoordinatorChannel:
    """Ordered messages from process 0 to every other process of the job this process joined."""

    def __init__(self) -> None:
        from jax._src import distributed  # the joined client; jax exposes no getter

        state = distributed.global_state
        if state.client is None:
            raise LinnetError("the lockstep needs the processes joined first (jax.distributed)")
        self._client: Any = state.client
        self.process_id, self.num_processes = state.process_id, state.num_processes
        self._next = 0  # the next message's number, sent (process 0) or awaited (the others)

    def send(self, message: bytes) -> None:
        """Process 0: the next message, to every other process."""
        self._client.key_value_set_bytes(self._key(self._next), message)
        self._next += 1

    def receive(self, timeout_s: float) -> bytes | None:
        """Another process: the next message, or None when none came within ``timeout_s`` (process 0 is idle);
        a LinnetError when the coordinator cannot be reached (process 0 is gone)."""
        try:
            message = self._client.blocking_key_value_get_bytes(self._key(self._next), max(1, int(timeout_s * 1000)))
        except Exception as e:  # jax's JaxRuntimeError, which names the gRPC status first
            if "DEADLINE_EXCEEDED" in str(e):
                return None
            # jax's client ends this process within moments of losing the coordinator, and its line
            # (``lost_process``) is the one to show; this one is for a client that did not
            time.sleep(LOST_GRACE_S)
            raise LinnetError(f"lost process 0 (the coordinator): {str(e).splitlines()[0]}") from None
        if self._next % BLOCK == BLOCK - 1:
            self._finish_block(self._next // BLOCK)
        self._next += 1
        return bytes(message)

    def wait_for_all(self, name: str, timeout_s: float) -> None:
        """Every process at the barrier ``name``, or a LinnetError after ``timeout_s``."""
        try:
            self._client.wait_at_barrier(f"{PREFIX}/{name}", int(timeout_s * 1000))
        except Exception as e:
            raise LinnetError(f"the processes did not all reach {name!r} within {timeout_s:g} s: "
                              f"{str(e).splitlines()[0]}") from None

    def _finish_block(self, block: int) -> None:
        """This follower has read every message of ``block``; the last of them to do so deletes it."""
        done = f"{PREFIX}/done/{block}"
        if self._client.key_value_increment(done, 1) == self.num_processes - 1:
            self._client.key_value_delete(f"{PREFIX}/{block}")  # the block's directory, every key under it
            self._client.key_value_delete(done)

    @staticmethod
    def _key(number: int) -> str:
        return f"{PREFIX}/{number // BLOCK}/{number % BLOCK}"

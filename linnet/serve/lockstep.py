"""``linnet serve`` across processes: process 0 serves, and every other process makes the same runner calls.

A model over several processes (``--num-processes``, xla:jax) runs one SPMD program: each step must run in
every process at once, on the same inputs. ``linnet run`` gets that by running the same loop everywhere; a
server's requests come to process 0 alone. So process 0's runner is a ``LeaderRunner``: before each call
that may touch the model (every public method but the pure ``QUERIES``, so a runner method added later is
mirrored too) it sends the call, name and arguments, to the others (a ``Channel``), whose ``follow`` loop
makes the same call on its own runner. Only process 0's results are used; a follower's are thrown away.

Sampling: a row drawing on the device draws from its seed in every process. A request without a seed is
given one here, kept for the row while its sampling stays the same (as the runner keeps its stream), so the
processes' device draws agree. A row whose logits a ``Control`` adjusts (a grammar, penalties) draws on the
host, from process 0's logits alone: its ``adjust`` (a closure) is not sent, and a follower takes the same
host path with its logits left as they are.

Arguments travel pickled, and a follower unpickles only the classes in ``_ALLOWED`` (the runner's own
dataclasses): the coordinator's store is no channel for code. A call whose arguments hold anything else is
refused in process 0, before it is sent.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import pickle
import random
import sys
import threading
from typing import Any, Protocol

from linnet.backends.runner import Control, Decode, Prefill, Runner
from linnet.errors import LinnetError
from linnet.sampling import SEED_MAX, Sampling

# The runner's public methods that only answer from host state: run in process 0 alone.
QUERIES = frozenset({"can_keep", "copied_slots", "decode_sizes", "describe", "peak_memory", "prompt_groups"})
WAIT_S = 1.0  # how long a follower's wait lasts before it asks again (a lost process 0 fails the wait at once)
STOP_TIMEOUT_S = 60  # how long process 0, stopping, waits for the followers to have read its stop
_STOP = "stop"


class Channel(Protocol):
    def send(self, message: bytes) -> None: ...

    def receive(self, timeout_s: float) -> bytes | None: ...

    def wait_for_all(self, name: str, timeout_s: float) -> None: ...


def adjusted_in_process_0(logits: Any) -> None:
    """A follower's stand-in for a row's ``Control.adjust``: process 0 adjusts the row's logits and draws its
    token; a follower's draw is thrown away, so its logits stay as they are."""


class LeaderRunner:
    """Process 0's runner: each call but the ``QUERIES`` is sent to the followers, then made here. Attributes
    are read from the runner; one set here is set in every process."""

    def __init__(self, runner: Runner, channel: Channel):
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_lock", threading.Lock())  # a call is sent and made before the next is sent
        object.__setattr__(self, "_seeds", {})  # row -> (its sampling as asked, the same with the seed it was given)
        object.__setattr__(self, "_stopped", False)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._runner, name)
        if name.startswith("_") or name in QUERIES or not callable(value):
            return value

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, args, kwargs)

        return mirrored

    def __setattr__(self, name: str, value: Any) -> None:
        with self._lock:
            self._send(("set", name, (value,), {}))
            setattr(self._runner, name, value)

    def stop_followers(self) -> None:
        """Tell the followers to end, and wait (at most ``STOP_TIMEOUT_S``) until each has read it; once only."""
        with self._lock:
            if self._stopped:
                return
            object.__setattr__(self, "_stopped", True)
            self._channel.send(pickle.dumps(_STOP))
        self._channel.wait_for_all("stopped", STOP_TIMEOUT_S)

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            if self._stopped:
                raise LinnetError(f"{name}: the followers have stopped")
            if name == "step":
                args, kwargs = self._seeded_step(args, kwargs)
            elif name in ("reset", "copy_row"):  # a row that starts afresh starts a fresh stream
                self._forget_seed(_bind(getattr(type(self._runner), name), args, kwargs))
            self._send(("call", name, args, kwargs))
            return getattr(self._runner, name)(*args, **kwargs)

    def _send(self, call: tuple) -> None:
        message = _dumps(call)
        try:
            _loads(message)  # what a follower could not read is refused here, before anything is sent
        except LinnetError as e:
            raise LinnetError(f"linnet serve across processes cannot send {call[1]}: {e}") from None
        self._channel.send(message)

    def _seeded_step(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``step``'s arguments with a seed for every sampled row that has none (the module's docstring)."""
        bound = _bind(type(self._runner).step, args, kwargs)
        for p in bound.arguments.get("prefill", ()):
            if p.start == 0:  # a new request: the runner starts its stream afresh, and so its seed
                self._seeds.pop(p.row, None)
        sampling = bound.arguments.get("sampling")
        if not sampling:
            return args, kwargs
        seeded = dict(sampling)
        for row, asked in sampling.items():
            if asked.seed is not None or asked.greedy:
                continue
            kept = self._seeds.get(row)
            if kept is None or kept[0] != asked:
                kept = self._seeds[row] = (asked, dataclasses.replace(asked, seed=random.randint(0, SEED_MAX)))
            seeded[row] = kept[1]
        if "sampling" in kwargs:  # the call keeps its form: a wrapped step sees what its caller passed
            return args, {**kwargs, "sampling": seeded}
        at = list(bound.signature.parameters).index("sampling") - 1  # less self
        return (*args[:at], seeded, *args[at + 1:]), kwargs

    def _forget_seed(self, bound: inspect.BoundArguments) -> None:
        for name in ("row", "target"):
            if name in bound.arguments:
                self._seeds.pop(bound.arguments[name], None)


def _bind(method: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """A call's arguments by name, under the class's own signature (an instance's method may be wrapped)."""
    return inspect.signature(method).bind(None, *args, **kwargs)


def follow_calls(runner: Runner, channel: Channel, label: str) -> None:
    """Make process 0's calls on ``runner``, in its order, until it sends stop; ``label`` names this process
    in the lines it prints. A call that fails here failed in process 0 too (same runner, same arguments),
    which told its caller; the follower says so in a line and goes on. A LinnetError when process 0 is lost."""
    while True:
        message = channel.receive(WAIT_S)
        if message is None:
            continue
        call = _loads(message)
        if call == _STOP:
            channel.wait_for_all("stopped", STOP_TIMEOUT_S)
            return
        kind, name, args, kwargs = call
        try:
            if kind == "set":
                setattr(runner, name, *args)
            else:
                getattr(runner, name)(*args, **kwargs)
        except Exception as e:  # the same error process 0 met and answered; the lockstep goes on
            print(f"{label}: {name} failed, as in process 0: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


# -- the calls' bytes -----------------------------------------------------------------------------
_ALLOWED = {("linnet.backends.runner", "Prefill"): Prefill, ("linnet.backends.runner", "Decode"): Decode,
            ("linnet.backends.runner", "Control"): Control, ("linnet.sampling", "Sampling"): Sampling,
            (__name__, "adjusted_in_process_0"): adjusted_in_process_0}


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Control) and obj.adjust is not None:  # a closure of process 0's: not sent
            return Control, (), {**obj.__dict__, "adjust": adjusted_in_process_0}
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise LinnetError(f"its arguments hold a {module}.{name}, which the lockstep does not send "
                              "(linnet.serve.lockstep._ALLOWED)")
        return found


def _dumps(call: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(call)
    return out.getvalue()


def _loads(message: bytes) -> Any:
    return _Unpickler(io.BytesIO(message)).load()

"""One model across processes: JAX's multi-process runtime (``jax.distributed``) joins P processes, one per
host, into one set of devices, and ``xla:jax`` shards its step over all of them (``sharding.py``) as it does
over one process's devices. Every process runs the same step on the same inputs; XLA's collectives cross
the processes (gloo on CPUs, NCCL on GPUs).

Process 0 hosts the coordinator at HOST:PORT; the others connect to it. ``join`` must run before anything
starts JAX's client (``jax.devices()``), since the client is built for the processes it joined.
"""
from __future__ import annotations

import io
import os
import sys
import threading

from linnet.backends.xla.lost_process import one_line_when_lost
from linnet.errors import LinnetError

DEFAULT_TIMEOUT_S = 300  # jax.distributed's own default for every process to connect
_JAX_GRACE_S = 30  # jax's own deadline comes this much after ours, so ours always fires first


def check_processes(num_processes: int, process_id: int, coordinator: str | None, timeout_s: int) -> None:
    """Refuse a process set-up that cannot join, by the flag that is wrong."""
    if num_processes < 1:
        raise LinnetError(f"--num-processes must be at least 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise LinnetError(f"--process-id must be 0 to {num_processes - 1} with --num-processes {num_processes}, "
                          f"got {process_id}")
    if num_processes > 1 and not coordinator:
        raise LinnetError("--num-processes needs --coordinator HOST:PORT, the address process 0 listens on")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise LinnetError(f"--coordinator must be HOST:PORT with a port of 1 to 65535, got {coordinator!r}")
    if timeout_s < 1:
        raise LinnetError(f"--coordinator-timeout must be at least 1 second, got {timeout_s}")


def join(num_processes: int, process_id: int, coordinator: str | None, timeout_s: int = DEFAULT_TIMEOUT_S) -> None:
    """Join this process to the others (``jax.distributed.initialize``); a second call with the same
    set-up (a second runner in this process) is a no-op."""
    check_processes(num_processes, process_id, coordinator, timeout_s)
    import jax
    from jax._src import distributed as jax_distributed  # the joined set-up; jax exposes no getter

    if jax.distributed.is_initialized():
        state = jax_distributed.global_state
        if (state.num_processes, state.process_id, state.coordinator_address) != (
                num_processes, process_id, coordinator):
            raise LinnetError(f"this process already joined {state.num_processes} processes as process "
                              f"{state.process_id} at {state.coordinator_address}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # jax's preemption service catches SIGTERM in C++ (to checkpoint training jobs), so `linnet serve`'s
    # own handler never saw it and a SIGTERM'd process 0 neither drained nor stopped; Linnet uses none of it
    jax.config.update("jax_enable_preemption_service", False)
    one_line_when_lost(f"linnet: error: --num-processes {num_processes}: process {process_id} lost the others: a "
                       f"process of the job, or process 0 (the coordinator at {coordinator}), stopped answering; this "
                       "process ends with it")
    _native_stdout_to_stderr()
    # When a process never arrives, jax's client aborts the whole process (a C++ check failure, SIGABRT,
    # and a stack trace), which no Python handler can catch; a timer of ours fires first and exits with
    # one line instead. It runs while initialize blocks: the connect releases the GIL.
    watchdog = threading.Timer(timeout_s, _give_up, (num_processes, process_id, coordinator, timeout_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            jax.distributed.initialize(coordinator, num_processes, process_id,
                                       initialization_timeout=timeout_s + _JAX_GRACE_S)
        except RuntimeError as e:  # JAX's client started before this call (something asked for its devices)
            raise LinnetError(f"cannot join the processes: {e}") from None
        _connect_collectives()
    finally:
        watchdog.cancel()


def _connect_collectives() -> None:
    """Sum a one over every device of every process, so that the processes' collectives connect now, under
    the watchdog, rather than in the first step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(jax.devices(), ("all",))
    ones = jax.make_array_from_callback((jax.device_count(),), NamedSharding(mesh, PartitionSpec("all")),
                                        lambda _: np.ones(1, np.int32))
    total = int(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(ones))
    if total != jax.device_count():
        raise LinnetError(f"the joined processes' devices summed {total} ones, not {jax.device_count()}")


def _native_stdout_to_stderr() -> None:
    """gloo's C++ prints a line on file descriptor 1 each time it connects a group of devices (in the
    first step that reduces over that group, not only at the join), amid the text; here fd 1 becomes
    stderr for native code, and Python's ``sys.stdout`` keeps the real stdout under another descriptor."""
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(io.FileIO(stdout, "w"), encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                                  line_buffering=bool(sys.stdout.line_buffering))


def _give_up(num_processes: int, process_id: int, coordinator: str, timeout_s: int) -> None:
    if process_id == 0:
        why = (f"the other {num_processes - 1} process(es) did not all connect to the coordinator at {coordinator} "
               f"within {timeout_s} s; start each with --coordinator {coordinator} and its own --process-id")
    else:
        why = (f"no coordinator answered at {coordinator} within {timeout_s} s; start process 0 "
               f"(--process-id 0) on that host, or check the address and port")
    sys.stderr.write(f"linnet: error: --num-processes {num_processes}: {why}\n")
    sys.stderr.flush()
    os._exit(2)  # the main thread is inside jax's connect, which only returns by aborting the process

"""``linnet serve MODEL --replicas N``: start (or join) Ray, deploy the application, serve until a signal."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from linnet.errors import LinnetError

APP_NAME = "linnet"


def serve_with_ray(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve

        from linnet.ray.deployment import DEFAULT_ROUTER, WORKER_ENV, build, check_scaling
    except ModuleNotFoundError as e:
        raise LinnetError(f"--replicas, --ray-address, --router and autoscaling need Ray Serve ({e.name} is not "
                          "installed): pip install 'linnet[ray]'") from None
    check_scaling(args)  # before Ray starts: a mistake in the flags fails in a moment
    if args.ray_address is None:  # the replicas run here, so the model must open here (a cluster's may not)
        from linnet.model import open_model

        open_model(args.model)
    application = build(args)
    if args.ray_address is None:  # a Ray of our own: its proxy, which relays every token too, runs as ours do
        os.environ.update(WORKER_ENV)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a server sends nobody its usage unasked
    # A Ray of our own runs no dashboard: its processes held 0.9 of the 2.5 GiB a one-replica server took
    # (docs/SCALE.md). A cluster's dashboard is its own.
    ray.init(address=args.ray_address, include_dashboard=False if args.ray_address is None else None)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(application, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica failed to start (its traceback went to the log above)
            raise LinnetError(f"the replicas did not start (their error is in the log above): "
                              f"{last_error_line(str(e))}") from None
        host = f"[{args.host}]" if ":" in args.host else args.host
        scale = (f"{args.min_replicas}..{args.max_replicas} replicas" if args.min_replicas is not None
                 else f"{args.replicas or 1} replicas")
        print(f"linnet serve: {args.name or args.model} on Ray Serve, {scale} of {args.rows} rows x "
              f"{args.positions} positions, {args.router or DEFAULT_ROUTER} routing; http://{host}:{args.port}/v1",
              file=sys.stderr, flush=True)
        stopped_by = wait_for_signal()
        serve.delete(APP_NAME)
    finally:
        if args.ray_address is None:  # a Ray of our own: stopped with us; a cluster we joined goes on
            serve.shutdown()
        ray.shutdown()
    print(f"linnet serve: stopped ({stopped_by})", file=sys.stderr, flush=True)
    return 0


def last_error_line(message: str) -> str:
    """The line of a deployment failure that says what went wrong (Ray's message ends with the replica's
    traceback, whose last line is the exception)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else "no reason given"


def wait_for_signal() -> str:
    """Block until SIGINT or SIGTERM; the signal's name."""
    received: list[str] = []
    done = threading.Event()

    def on_signal(number: int, _: object) -> None:
        received.append(signal.Signals(number).name)
        done.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    while not done.wait(1.0):  # a timeout, so that the signal handler runs promptly on the main thread
        pass
    return received[0]

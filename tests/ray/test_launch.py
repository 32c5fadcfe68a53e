"""``linnet serve --replicas`` and the application builder's arguments, without starting Ray: a missing Ray
is a clear error naming the extra; the builder's arguments are ``linnet serve``'s flags, checked by its
own parser; scaling flags that cannot work are refused by name."""
from __future__ import annotations

import os
import re
import sys

import pytest

from linnet.cli import main
from linnet.errors import LinnetError


def test_replicas_without_ray_name_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: importing it raises ModuleNotFoundError
    assert main(["serve", "no-such-model", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'linnet[ray]'" in err and "Traceback" not in err


@pytest.fixture
def app_module():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'linnet[ray]'")
    from linnet.ray import deployment as app

    return app


def test_builder_arguments_are_linnet_serves_flags(app_module):
    args = app_module.serve_options({"model": "some/model", "backend": "reference:numpy", "rows": 4,
                                     "replicas": "3", "prefix_cache": "false", "api_key": "k"})
    assert (args.model, args.backend, args.rows, args.replicas, args.prefix_cache, args.api_key) == \
        ("some/model", "reference:numpy", 4, 3, False, "k")
    assert args.positions == 640 and args.min_replicas is None  # the rest: linnet serve's defaults
    with pytest.raises(LinnetError, match="linnet.ray:app: .*--rows"):
        app_module.serve_options({"rows": 0})
    with pytest.raises(LinnetError, match="unrecognized arguments: --colour"):
        app_module.serve_options({"colour": "red"})


@pytest.mark.parametrize("flags, message", [
    (["--min-replicas", "1"], "--min-replicas and --max-replicas go together"),
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is more than --max-replicas 2"),
    (["--replicas", "5", "--min-replicas", "1", "--max-replicas", "2"], "--replicas 5 .* is outside"),
])
def test_scaling_flags_that_cannot_work_are_refused(app_module, capsys, flags, message):
    assert main(["serve", "no-such-model", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


@pytest.mark.parametrize("options, most", [({"replicas": 3}, 3), ({"min_replicas": 1, "max_replicas": 5}, 5)])
def test_the_ingress_takes_every_request_the_replicas_have_room_for(app_module, options, most):
    # The ingress holds a request until its response ends: at Ray's default limit (5) it let 5 of 16 rows
    # generate, and one replica served a third of what linnet serve alone does.
    ingress = app_module.build(app_module.serve_options({"model": "m", "rows": 8, **options}))._bound_deployment
    replica = ingress.init_args[0]._bound_deployment
    assert replica.max_ongoing_requests == 2 * 8
    assert ingress.max_ongoing_requests == most * replica.max_ongoing_requests
    for deployment in (ingress, replica):  # the service's own work, not niced below the machine's other work
        assert deployment.ray_actor_options["runtime_env"]["env_vars"]["RAY_worker_niceness"] == "0"


def test_one_replica_not_autoscaled_takes_http_without_the_ingress(app_module):
    # nothing to route: the ingress's hop for every streamed token would be pure cost
    alone = app_module.build(app_module.serve_options({"model": "m", "rows": 8}))._bound_deployment
    assert alone.func_or_class is app_module.ServedReplica and alone.max_ongoing_requests == 2 * 8
    for options in ({"replicas": 2}, {"min_replicas": 1, "max_replicas": 1}):
        routed = app_module.build(app_module.serve_options({"model": "m", **options}))._bound_deployment
        assert routed.name == "LinnetIngress"


class _Started(Exception):
    pass


@pytest.mark.parametrize("address, dashboard", [(None, False), ("10.0.0.1:6379", None)])
def test_a_ray_of_our_own_starts_without_a_dashboard(app_module, monkeypatch, address, dashboard):
    """A local Ray that ``linnet serve --replicas`` starts runs no dashboard (most of its memory) and sends no
    usage statistics; a cluster joined with ``--ray-address`` is left as it is."""
    import ray

    from linnet.ray import launch

    given: dict = {}

    def init(**kwargs):
        given.update(kwargs)
        raise _Started

    monkeypatch.setattr(ray, "init", init)
    environment = {k: v for k, v in os.environ.items() if k != "RAY_USAGE_STATS_ENABLED"}
    monkeypatch.setattr(os, "environ", environment)  # what the launch sets stays in the test
    flags = ["serve", "smollm2-135m-instruct", "--replicas", "2"] + (["--ray-address", address] if address else [])
    from linnet.cli import build_parser

    with pytest.raises(_Started):
        launch.serve_with_ray(build_parser().parse_args(flags))
    assert given == {"address": address, "include_dashboard": dashboard}
    assert (environment.get("RAY_USAGE_STATS_ENABLED") == "0") == (address is None)

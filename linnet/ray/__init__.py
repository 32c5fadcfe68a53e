"""Linnet on Ray Serve: replicas of ``linnet serve``'s engine behind one endpoint, routed by prompt prefix.

``linnet serve MODEL --replicas N`` runs it; ``serve run linnet.ray:app model=MODEL replicas=N`` and a Serve
config file deploy it (docs/SCALE.md). Ray is an optional extra (``pip install 'linnet[ray]'``): this
package imports it only when an application is built, and ``linnet.ray.router`` never does.
"""
from __future__ import annotations

from typing import Any


def app(config: dict[str, Any]) -> Any:
    """The Ray Serve application builder: ``linnet serve``'s options as ``key=value`` arguments
    (``linnet.ray.deployment.serve_options``)."""
    from linnet.ray.deployment import app as build_app

    return build_app(config)

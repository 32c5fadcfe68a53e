"""How OpenMP threads wait: torch's CPU kernels and inductor's loops run on libgomp (Linux).

A thread that waits at a barrier either spins (it wakes at once, but holds a core) or sleeps (another
thread must wake it). Measured on this project's 2-core VMs (docs/BENCH.md): sleeping at once
(`PASSIVE`) cost 10-12% of an inductor decode step on an Intel Xeon, whose ~330 barriers each waited
about 25 us for a woken thread; spinning without end (`ACTIVE`, or libgomp's default 300,000 spins)
made decoding 2-4x slower while other processes wanted the cores. A brief spin, then sleep, measured
as fast as spinning on the quiet machine and no slower than sleeping on the busy one.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping

POLICIES: dict[str, dict[str, str]] = {
    "brief": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},  # spin 1000 times, then sleep
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},  # sleep at once
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},  # never sleep
}
DEFAULT = "brief"
VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def policy_environment(env: Mapping[str, str], policy: str) -> dict[str, str]:
    """``env`` with ``policy``'s variables and no other of ``VARIABLES``; "inherit" leaves it as it is."""
    if policy == "inherit":
        return dict(env)
    if policy not in POLICIES:
        raise ValueError(f"unknown OpenMP wait policy {policy!r}; choose from {', '.join(POLICIES)}, inherit")
    return {**{k: v for k, v in env.items() if k not in VARIABLES}, **POLICIES[policy]}


def set_default_policy(env: MutableMapping[str, str]) -> None:
    """The default policy, unless the caller chose how OpenMP waits (set before torch loads OpenMP)."""
    if not any(name in env for name in VARIABLES):
        env.update(POLICIES[DEFAULT])


def describe(env: Mapping[str, str]) -> str:
    """The OpenMP wait settings of ``env``, for a benchmark's notes."""
    return ", ".join(f"{name}={env[name]}" for name in VARIABLES if name in env) or "OMP_WAIT_POLICY unset"

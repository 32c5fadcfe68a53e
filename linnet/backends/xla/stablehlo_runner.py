"""``xla:stablehlo``: Linnet's own StableHLO modules, compiled and run by the PJRT client that jaxlib ships.

JAX is used for its client and its arrays (and the draw of the next token), never to trace the model.
"""
from __future__ import annotations

import re
import time
from typing import Any

import jax
import numpy as np
from jax.extend.backend import get_backend

from linnet.backends.runner import CacheShape
from linnet.backends.xla import disk_cache
from linnet.backends.xla.codegen import generate_source
from linnet.backends.xla.layout import xla_program
from linnet.backends.xla.runner import XlaRunner, load_generated_module
from linnet.backends.xla.stablehlo import Sizes, emit_module, weight_shapes
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.rope import rope_tables
from linnet.weight_plan import WeightPlan, plan_weights
from linnet.weights import Weights


def compile_module(text: str, entry: str):
    """A loaded PJRT executable of the module; a module XLA rejects is an error naming it and the op."""
    from jax._src.lib import xla_client

    client = get_backend()
    devices = xla_client.DeviceList(tuple(client.local_devices()[:1]))

    def build():
        try:
            return client.compile_and_load(text, devices, xla_client.CompileOptions())
        except Exception as e:  # jaxlib raises its JaxRuntimeError, with MLIR's diagnostics in the message
            raise LinnetError(f"XLA rejected the StableHLO module {entry!r}{_where(str(e), text)}") from None

    return disk_cache.load_or_compile(text, client, devices, build)


def _where(message: str, text: str) -> str:
    """" at OP (LOCATION): DIAGNOSTIC", the op found by the location (unique per line) in the module."""
    found = re.search(r'loc\("([^"]*)"\): ([^\n]*)', message)
    if not found:
        return f": {message.strip().splitlines()[0]}"
    line = next((line for line in text.splitlines() if f'loc("{found[1]}")' in line), "")
    op = re.search(r'= "?((?:stablehlo|chlo)\.\w+)', line)
    return f" at {op[1] if op else 'an op'} ({found[1]}): {found[2]}"


def module_name(sizes: Sizes) -> str:
    if sizes.T == 1:
        return "decode"
    return "prefill" if sizes.S == 1 else "prefill_every_token"


class StableHloRunner(XlaRunner):
    def __init__(self, weights: Weights, cache: CacheShape = CacheShape(), dtype: str = "f32"):
        super().__init__(weights, cache, dtype, "stablehlo")
        start = time.perf_counter()
        spec = weights.spec
        self.program = self._with_rings(xla_program(spec, dtype))
        arrays = plan_weights(weights, WeightPlan.of(self.program))
        self.weights = [jax.device_put(arrays[name]) for name, _ in weight_shapes(self.program)]
        shapes = [(cache.rows, spec.num_kv_heads, self.program.cache_slots(kind, cache.positions), spec.head_dim)
                  for kind in self.program.layer_kinds]
        self.caches = [jax.device_put(np.zeros(shape, DTYPES[dtype].numpy)) for shape in shapes * 2]  # k, then v
        self.rope = [jax.device_put(t) for t in rope_tables(spec, self.positions)]
        self.executables: dict[Sizes, Any] = {}  # jaxlib's loaded PJRT executables
        # The draw of the next token is the generated JAX's `sample` (it is not the model).
        self._draw = jax.jit(load_generated_module(generate_source(self.program)).sample)
        self.load_time = weights.load_time + time.perf_counter() - start

    def _copy_cache(self, source: int, target: int, length: int) -> None:
        self.caches = self._copied(self.caches, source, target)

    def _call(self, tokens, positions, rows, select) -> jax.Array:
        r, t = tokens.shape
        sizes = Sizes(r, t, select.shape[1], self.cache.rows, self.positions)
        if sizes not in self.executables:
            self.executables[sizes] = compile_module(emit_module(self.program, sizes, module_name(sizes)),
                                                     module_name(sizes))
        inputs = [jax.device_put(a.astype(np.int32)) for a in (tokens, positions, rows, select)]
        results = self.executables[sizes].execute_sharded([*inputs, *self.caches, *self.rope, *self.weights])
        (logits, *self.caches) = [r[0] for r in results.disassemble_into_single_device_arrays()]
        return logits

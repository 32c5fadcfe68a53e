"""Run a Program through XLA: ``xla:jax`` (generated JAX source, jitted) or ``xla:stablehlo`` (Linnet's own
StableHLO, compiled by the PJRT client jaxlib ships). Both keep every shape fixed, so each compiles once:
decode runs every cache row with one token, and prefill chunks are padded to one length, the padding
writing the scratch position and never selected. Tokens are drawn on the device; only their ids leave it.
"""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linnet.backends import generated
from linnet.backends.runner import CacheShape, Runner
from linnet.backends.xla import disk_cache
from linnet.backends.xla.codegen import generate_source
from linnet.backends.xla.layout import as_tree, stacked_weights, xla_program
from linnet.backends.xla.sharding import Sharding, place
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.rope import rope_tables
from linnet.sampling import Sampling
from linnet.weights import Weights

SHORT_CHUNK = 32  # the longest chunk with every logit read that pads to a power of two, not a prefill chunk


def load_generated_module(source: str) -> ModuleType:
    return generated.load_generated_module(source, "jax")


def _copy_row(caches: list[jax.Array], source: jax.Array, target: jax.Array) -> list[jax.Array]:
    return [cache.at[target].set(cache[source]) for cache in caches]


class _Key:
    """A row's random stream: a JAX key on the device, advanced by each draw."""

    def __init__(self, seed: int):
        self.key = jax.random.PRNGKey(seed)


class XlaRunner(Runner):
    """The Runner hooks over JAX arrays; subclasses compile the step (``_call``)."""

    def __init__(self, weights: Weights, cache: CacheShape, dtype: str, mode: str):
        if dtype not in DTYPES:
            raise LinnetError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        super().__init__(weights.spec, cache)
        disk_cache.use_for_jit()  # before the first jit below compiles
        self.name, self.dtype = f"xla:{mode}", dtype
        self.positions = cache.positions + 1  # and the scratch position
        self._greedy = jax.jit(lambda logits: jnp.argmax(logits, axis=-1))
        self._draw: Callable[..., Any] | None = None  # the generated `sample`, jitted; set by subclasses
        self._copy: Callable[..., Any] | None = None  # ``_copied``, jitted at its first call

    def _copied(self, caches: list[jax.Array], source: int, target: int) -> list[jax.Array]:
        """``caches`` with row ``source`` copied whole into row ``target`` (``copy_row``): whole rows make one
        shape, compiled once, where copying ``length`` positions would compile for every length. The caches
        are donated and keep their shardings."""
        if self._copy is None:
            self._copy = jax.jit(_copy_row, donate_argnums=0, out_shardings=[c.sharding for c in caches])
        return self._copy(caches, np.int32(source), np.int32(target))

    def _call(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray) -> jax.Array:
        raise NotImplementedError

    def _forward(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray | None):
        r, t = tokens.shape
        if t == 1 and select is None:  # a decode step: every row, one token
            return self._call(tokens, positions, rows, np.zeros((r, 1), np.int64))
        every = select is None
        length = self._all_logits_length(t) if every else self.padded_length
        pad = ((0, 0), (0, length - t))
        tokens = np.pad(tokens, pad)
        positions = np.pad(positions, pad, constant_values=self.scratch_position)
        if select is None:
            select = np.broadcast_to(np.arange(length), (r, length))
        out = self._call(tokens, positions, rows, select)
        return out[:, :t] if every else out

    @property
    def padded_length(self) -> int:
        """The one length of every prefill chunk whose last logits alone are read (a chunk never exceeds the
        cache)."""
        return min(self.prefill_chunk, self.cache.positions)

    def _all_logits_length(self, tokens: int) -> int:
        """A chunk whose every position's logits are read pads to the next power of two up to
        SHORT_CHUNK tokens (a speculative check of k + 1 tokens then computes at most 2k positions and
        their logits, not a whole prefill chunk's: a few shapes, each compiled once), longer ones to
        ``padded_length``."""
        if tokens <= SHORT_CHUNK:
            return min(1 << (tokens - 1).bit_length(), self.padded_length)
        return self.padded_length

    def all_logits_lengths(self, tokens: int) -> tuple[int, ...]:
        return tuple(sorted({self._all_logits_length(t) for t in range(2, tokens + 1)}))

    # -- sampling on the device: only the chosen ids come back ----------------------------------------
    def _stack(self, picks: list[tuple[Any, int]]) -> jax.Array:
        """[ROWS, vocab], the picks first: one shape for every step, so the draw compiles once."""
        arrays = {id(a) for a, _ in picks}
        indices = [i for _, i in picks]
        if len(arrays) == 1:
            stacked = picks[0][0][np.array(indices), 0]
        else:
            stacked = jnp.stack([a[i, 0] for a, i in picks])
        return jnp.pad(stacked, ((0, self.cache.rows - len(picks)), (0, 0)))

    def _to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array, dtype=np.float32)

    def _new_rng(self, seed: int | None) -> _Key:
        return _Key(random.getrandbits(32) if seed is None else seed)

    def _sample(self, logits: jax.Array, samplers: list[tuple[Sampling, Any]]) -> list[int]:
        n = len(samplers)
        if all(s.greedy for s, _ in samplers):
            return np.asarray(self._greedy(logits))[:n].tolist()
        rows = self.cache.rows
        temperature, top_k, top_p = np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32)
        for i, (s, _) in enumerate(samplers):
            if not s.greedy:
                temperature[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
        unused = jax.random.PRNGKey(0)
        keys = jnp.stack([key.key for _, key in samplers] + [unused] * (rows - n))
        assert self._draw is not None  # set by every subclass
        tokens, keys = self._draw(logits, temperature, top_k, top_p, keys)
        for i, (s, key) in enumerate(samplers):
            if not s.greedy:
                key.key = keys[i]
        return np.asarray(tokens)[:n].tolist()

    def describe(self) -> dict:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # XLA's CPU client sized its thread pools from the CPUs this process may use (setup.set_threads)
        return {**super().describe(), "dtype": self.dtype, "device": str(jax.local_devices()[0]), "threads": threads}

    def peak_memory(self) -> int:
        """The device's allocator peak where it reports one (a GPU); the process's peak RSS on a CPU."""
        stats = jax.local_devices()[0].memory_stats() or {}  # this process's: another's cannot be asked
        return stats.get("peak_bytes_in_use") or super().peak_memory()


class JaxRunner(XlaRunner):
    """The generated JAX module's ``step`` under ``jax.jit``, its caches donated."""

    def __init__(self, weights: Weights, cache: CacheShape = CacheShape(), dtype: str = "f32", devices: int = 1,
                 processes: int = 1):
        """``processes`` > 1: this process has joined others (``distributed.join``), and the step is sharded
        over every process's devices."""
        super().__init__(weights, cache, dtype, "jax")
        start = time.perf_counter()
        spec = weights.spec
        self.devices, self.processes = devices, processes
        sharded = devices > 1 or processes > 1
        program = self._with_rings(xla_program(spec, dtype, sharded=sharded))
        self.source = generate_source(program)
        module = load_generated_module(self.source)
        # across processes each reads only its slices of the mapped file (sharding.place), so none reads it all ahead
        tree = as_tree(stacked_weights(weights, program, settle=processes == 1), spec.num_layers)
        zeros = [np.zeros((cache.rows, spec.num_kv_heads, program.cache_slots(kind, cache.positions), spec.head_dim),
                          DTYPES[dtype].numpy) for kind in program.layer_kinds]
        cos, sin = rope_tables(spec, self.positions)
        if not sharded:
            self.weights = jax.device_put(tree)
            self.cache_k, self.cache_v = ([jax.device_put(layer) for layer in zeros] for _ in "kv")
            self.rope = jax.device_put(cos), jax.device_put(sin)
            self._step = jax.jit(module.step, donate_argnames=("cache_k", "cache_v"))
        else:
            sharding = Sharding(spec, devices, processes)
            self.devices = sharding.mesh.size
            self.weights = sharding.put(tree)
            self.cache_k, self.cache_v = ([place(layer, sharding.cache) for layer in zeros] for _ in "kv")
            self.rope = place(cos, sharding.replicated), place(sin, sharding.replicated)
            caches = [sharding.cache] * spec.num_layers
            out = (sharding.replicated, caches, caches)
            self._step = jax.jit(module.step, donate_argnames=("cache_k", "cache_v"), out_shardings=out)
        self._draw = jax.jit(module.sample)
        self.load_time = weights.load_time + time.perf_counter() - start

    def _copy_cache(self, source: int, target: int, length: int) -> None:
        layers = len(self.cache_k)
        copied = self._copied([*self.cache_k, *self.cache_v], source, target)
        self.cache_k, self.cache_v = copied[:layers], copied[layers:]

    def _call(self, tokens, positions, rows, select) -> jax.Array:
        logits, self.cache_k, self.cache_v = self._step(
            self.weights, self.cache_k, self.cache_v, *self.rope,
            tokens.astype(np.int32), positions.astype(np.int32), rows.astype(np.int32), select.astype(np.int32))
        return logits

    def describe(self) -> dict:
        return {**super().describe(), "devices": self.devices, "processes": self.processes}

"""Tensor parallelism over N devices with ``jax.sharding``: a one-axis mesh, XLA's SPMD partitioner doing
the rest.

The query heads and the MLP's intermediate columns are split over the devices (q/k/v and gate/up by
their output rows, o and down by their input columns), so each device computes its own heads and its
share of the MLP, and one sum across devices follows each of o and down. The KV cache is split by kv
head when the devices divide the kv heads; with fewer kv heads than devices (MQA) the keys and values
are computed and kept whole on every device; so is the MLP where the devices do not divide its width.

Across processes (``distributed.py``) the mesh spans every process's devices, and each process places
only its own devices' slices, read from the memory-mapped weights (``place``), never the whole matrix.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from linnet.errors import LinnetError
from linnet.spec import ModelSpec

AXIS = "model"
_BY_OUTPUT = {"q", "q_bias"}  # a layer's [out, in] and [out]: rows split
_BY_INPUT = {"o"}  # a layer's [out, in]: columns split
_KV = {"k", "k_bias", "v", "v_bias"}  # rows split when the devices divide the kv heads
_MLP_BY_OUTPUT, _MLP_BY_INPUT = {"gate", "up"}, {"down"}  # when the devices divide the intermediate size


def check_devices(spec: ModelSpec, devices: int, processes: int = 1) -> None:
    present = jax.devices()  # every process's, once joined
    if processes > 1:
        if devices != 1:
            raise LinnetError(f"--devices {devices}: with --num-processes the mesh is every device of every "
                              "process; leave --devices out")
        if spec.num_heads % len(present):
            raise LinnetError(f"--num-processes {processes}: the {len(present)} devices of all the processes do "
                              f"not divide the model's {spec.num_heads} attention heads")
        return
    if devices < 1:
        raise LinnetError(f"--devices must be at least 1, got {devices}")
    if devices > len(present):
        raise LinnetError(f"--devices {devices} asks for more devices than the {len(present)} "
                          f"{present[0].platform} device(s) JAX sees here")
    if spec.num_heads % devices:
        raise LinnetError(f"--devices {devices} does not divide the model's {spec.num_heads} attention heads")


class Sharding:
    """Where each stacked weight, the KV cache and everything else live on an N-device mesh."""

    def __init__(self, spec: ModelSpec, devices: int, processes: int = 1):
        check_devices(spec, devices, processes)
        if processes > 1:
            devices = jax.device_count()
        self.mesh = Mesh(jax.devices()[:devices], (AXIS,))
        self.kv_split = spec.num_kv_heads % devices == 0
        self.mlp_split = spec.intermediate_size % devices == 0
        self.replicated = self._named()
        self.cache = self._named(None, AXIS) if self.kv_split else self.replicated  # a layer's [ROWS, KV_HEADS, P, D]

    def _named(self, *axes: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*axes))

    def layer_weight(self, name: str) -> NamedSharding:
        if name in _BY_OUTPUT or (self.kv_split and name in _KV) or (self.mlp_split and name in _MLP_BY_OUTPUT):
            return self._named(AXIS)
        if name in _BY_INPUT or (self.mlp_split and name in _MLP_BY_INPUT):
            return self._named(None, AXIS)
        return self.replicated

    def put(self, tree: dict[str, Any]) -> dict[str, Any]:
        """The step's weights (``layout.as_tree``) placed: the layers' split, the rest on every device."""
        placed: dict[str, Any] = {name: place(a, self.replicated) for name, a in tree.items() if name != "layers"}
        placed["layers"] = [{name: place(a, self.layer_weight(name)) for name, a in layer.items()}
                            for layer in tree["layers"]]
        return placed


def place(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``array`` laid out by ``sharding``: each of this process's devices gets its slice, read from ``array``
    (a view of the memory-mapped weights, so only that slice is read), and other processes' slices are
    never touched."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

"""Weights: canonical name -> NumPy array, memory-mapped from safetensors (single file or sharded).

Arrays stay in the checkpoint's dtype (bf16 as ``ml_dtypes.bfloat16``), read-only views of the mapped
files until a backend converts them; a missing or misshapen tensor is an error naming it, its expected
shape and the shape found.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from linnet.errors import WeightError
from linnet.files import map_safetensors, naming, read_json
from linnet.names import expected_shapes, hf_alternative, hf_name
from linnet.spec import ModelSpec
from linnet.weight_cache import source_identity


class Weights(Mapping[str, np.ndarray]):
    """A read-only mapping of canonical names to arrays, checked against a spec."""

    def __init__(
        self,
        spec: ModelSpec,
        arrays: dict[str, np.ndarray],
        load_time: float = 0.0,
        source: str | None = None,
    ):
        check_shapes(spec, arrays)
        self.spec = spec
        self._arrays = arrays
        self.load_time = load_time
        self.source = source  # identity of what was read (keys converted-weights caches); None if in memory

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def head(self) -> np.ndarray:
        """The output projection: ``lm_head``, or ``embed`` when tied."""
        return self._arrays["embed" if self.spec.tie_word_embeddings else "lm_head"]


def check_shapes(spec: ModelSpec, arrays: Mapping[str, Any]) -> None:
    """Every tensor the spec needs is there with its shape (values need only a ``shape``)."""
    for name, shape in expected_shapes(spec).items():
        if name not in arrays:
            raise WeightError(f"missing weight {name!r} (expected shape {list(shape)})")
        found = tuple(arrays[name].shape)
        if found != shape:
            raise WeightError(f"weight {name!r} has shape {list(found)}, expected {list(shape)}")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, WeightError)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(_shard_name(s) for s in weight_map.values()):
            raise WeightError(f"{index}: weight_map: expected an object of tensor names to file names "
                              "in this directory")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise WeightError(f"{index} names shards that do not exist: {missing}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise WeightError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _shard_name(name: object) -> bool:
    """A plain file name: an index may not send Linnet to read files outside its directory."""
    return isinstance(name, str) and name not in ("", ".", "..") and not set(name) & set("/\\\0")


def load_safetensors(model_dir: str | Path, spec: ModelSpec) -> Weights:
    """Map every tensor the spec needs from an HF directory; extra tensors are ignored. Tensors the
    architecture packs together are cut into their canonical parts (views), those it may hold in another
    layout read from that where the first is absent (a tensor per expert stacked: a copy), and its
    load-time transforms applied."""
    from linnet.arch import get_architecture

    start = time.perf_counter()
    files = safetensors_files(Path(model_dir))
    arch = get_architecture(spec.architecture)
    needed = expected_shapes(spec)
    wanted = {name: c for c in needed if (name := hf_name(spec, c)) is not None}
    packed = {name: (pack, parts)  # HF name of a packed tensor -> (its Packed, the canonical names it holds)
              for template, pack in arch.hf_packed.items() for name, parts in pack.groups(spec, template, needed)}
    others = {c: group for c in needed if (group := hf_alternative(spec, c))}
    reads = {*wanted, *packed, *(n for group in others.values() for n in group)}
    mapped = {name: a for path in files for name, a in map_safetensors(path, reads).items()}
    arrays = {wanted[name]: a for name, a in mapped.items() if name in wanted}
    with naming(files[0] if len(files) == 1 else model_dir):
        for name, (pack, parts) in packed.items():
            if name in mapped:
                arrays.update(zip(parts, _unpacked(spec, pack, mapped[name], name)))
        for canonical, group in others.items():
            if canonical not in arrays and all(n in mapped for n in group):
                arrays[canonical] = mapped[group[0]] if len(group) == 1 else _stacked(mapped, group)
        for canonical in list(arrays):
            transform = arch.hf_transforms.get(canonical.rsplit(".", 1)[-1])
            if transform is not None:
                arrays[canonical] = transform.load(arrays[canonical])
        return Weights(spec, arrays, time.perf_counter() - start, source_identity(files))


def _unpacked(spec: ModelSpec, pack: Any, array: np.ndarray, name: str) -> tuple[np.ndarray, ...]:
    try:
        return pack.unpack(spec, array)
    except ValueError:
        raise WeightError(f"weight {name!r} of shape {list(array.shape)} does not hold "
                          f"{', '.join(pack.parts)} in the model's shapes") from None


def _stacked(mapped: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    """One tensor per expert, stacked along a new first axis."""
    shapes = {tuple(mapped[n].shape) for n in names}
    if len(shapes) != 1:
        raise WeightError(f"the experts' tensors {names[0]!r}... differ in shape: {sorted(shapes)}")
    return np.stack([mapped[n] for n in names])

"""Weights: canonical name -> tensor, memory-mapped from safetensors (single file or sharded).

Tensors stay in the checkpoint's dtype and are backed by the mapped file until a backend converts
them; a missing or misshapen tensor is an error naming it, its expected shape and the shape found.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from linnet.errors import WeightError
from linnet.names import expected_shapes, hf_name
from linnet.spec import ModelSpec
from linnet.weight_cache import source_identity

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class Weights(Mapping[str, torch.Tensor]):
    """A read-only mapping of canonical names to tensors, checked against a spec."""

    def __init__(
        self,
        spec: ModelSpec,
        tensors: dict[str, torch.Tensor],
        load_time: float = 0.0,
        source: str | None = None,
    ):
        check_shapes(spec, tensors)
        self.spec = spec
        self._tensors = tensors
        self.load_time = load_time
        self.source = source  # identity of the files read (for the converted-weights cache); None if in memory

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def head(self) -> torch.Tensor:
        """The output projection: ``lm_head``, or ``embed`` when tied."""
        return self._tensors["embed" if self.spec.tie_word_embeddings else "lm_head"]


def check_shapes(spec: ModelSpec, tensors: Mapping[str, torch.Tensor]) -> None:
    for name, shape in expected_shapes(spec).items():
        if name not in tensors:
            raise WeightError(f"missing weight {name!r} (expected shape {list(shape)})")
        found = tuple(tensors[name].shape)
        if found != shape:
            raise WeightError(f"weight {name!r} has shape {list(found)}, expected {list(shape)}")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise WeightError(f"{index} names shards that do not exist: {missing}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise WeightError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def load_safetensors(model_dir: str | Path, spec: ModelSpec) -> Weights:
    """Map every tensor the spec needs from an HF directory; extra tensors are ignored."""
    start = time.perf_counter()
    model_dir = Path(model_dir)
    wanted = {hf_name(c): c for c in expected_shapes(spec)}
    tensors: dict[str, torch.Tensor] = {}
    files = safetensors_files(model_dir)
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key in wanted:
                        tensors[wanted[key]] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own types for truncated/corrupt files
            raise WeightError(f"cannot read {path}: {e}") from None
    for name, tensor in tensors.items():
        if tensor.dtype not in TORCH_DTYPES.values():
            raise WeightError(f"weight {name!r} has dtype {tensor.dtype}; expected f32, f16 or bf16")
    return Weights(spec, tensors, time.perf_counter() - start, source_identity(files))

"""Run the generated PyTorch source: eager, inductor (torch.compile) or CUDA graphs.

Shapes are fixed so that compilation happens once: decode always runs every cache row with one token
(one graph, no recompiles per step), and prefill is compiled once with a dynamic prompt length.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
import time
from types import FunctionType, ModuleType

import numpy as np
import torch

from linnet.backends.runner import CacheShape, Runner
from linnet.backends.torch.codegen import generate_source
from linnet.errors import BackendUnavailable, LinnetError
from linnet.program import Program, build_program, fold_norm_weights, fuse_norm_linears, fuse_projections
from linnet.spec import ModelSpec
from linnet.weight_cache import cache_root, cached_tensors
from linnet.weights import TORCH_DTYPES, Weights

MODES = ("eager", "inductor", "cudagraphs")
_LAYOUT_VERSION = 5  # bump when prepare_weights changes, so cached conversions are not reused


def torch_program(spec: ModelSpec) -> Program:
    return fold_norm_weights(fuse_norm_linears(fuse_projections(build_program(spec))))


def prepare_weights(weights: Weights, program: Program, dtype: str) -> dict[str, torch.Tensor]:
    """The generated model's layout: run dtype, fused projections, norm weights folded into the matrices
    after them (in float32, rounded once to the run dtype); a tied head is bound by the model."""
    target = TORCH_DTYPES[dtype]
    tensors = dict(weights)
    layers = [f"layers.{i}." for i in range(weights.spec.num_layers)]
    for prefix in layers:
        for name, parts in program.fused:
            tensors[prefix + name] = torch.cat([tensors.pop(prefix + p) for p in parts])
    for section, name, norm in program.folded:
        for prefix in layers if section == "layer" else [""]:
            tensors[prefix + name] = tensors[prefix + name].float() * tensors.pop(prefix + norm).float()
    return {name: tensor.to(target).contiguous() for name, tensor in tensors.items()}


def load_generated_module(source: str) -> ModuleType:
    """Import generated source from a real file, so tracebacks and torch.compile see its lines."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = cache_root() / "generated" / f"linnet_torch_{digest}.py"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    if path.stem not in sys.modules:  # registered, since torch.compile re-imports globals' modules by name
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    return sys.modules[path.stem]


def default_device(mode: str) -> str:
    if mode == "cudagraphs":
        if not torch.cuda.is_available():
            raise BackendUnavailable("torch:cudagraphs needs a CUDA GPU, and none is available here")
        return "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _own_code(fn: FunctionType, tag: int) -> FunctionType:
    """fn with a code object of its own (the same code, renamed with tag)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag:x}")
    return FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class TorchRunner(Runner):
    def __init__(
        self,
        weights: Weights,
        cache: CacheShape = CacheShape(),
        dtype: str = "f32",
        mode: str = "eager",
        device: str | None = None,
    ):
        if mode not in MODES:
            raise LinnetError(f"unknown torch mode {mode!r}; choose from {', '.join(MODES)}")
        if dtype not in TORCH_DTYPES:
            raise LinnetError(f"unknown dtype {dtype!r}; choose from {', '.join(TORCH_DTYPES)}")
        super().__init__(weights.spec, cache)
        start = time.perf_counter()
        self.name = f"torch:{mode}"
        self.mode, self.dtype = mode, dtype
        self.device = torch.device(device or default_device(mode))
        program = torch_program(weights.spec)
        self.source = generate_source(program)
        module = load_generated_module(self.source)
        conversion = f"torch-{dtype}-layout{_LAYOUT_VERSION}"
        tensors = cached_tensors(weights.source, conversion, lambda: prepare_weights(weights, program, dtype))
        tensors = {name: t.to(self.device) for name, t in tensors.items()}
        self.model = module.Model(tensors, cache.rows, cache.positions, TORCH_DTYPES[dtype])
        self.all_rows = torch.arange(cache.rows, device=self.device)
        self._prefill_fn, self._decode_fn = self._step, self._step
        if mode in ("inductor", "cudagraphs"):
            self._compile()
        self._graph = None
        self.load_time = weights.load_time + time.perf_counter() - start

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, last_only: bool):
        return self.model(tokens, positions, rows, last_only)

    def _compile(self) -> None:
        from linnet.backends.torch.decode_compile import decode_compile_options  # imports inductor

        # No freezing: the decode products need no re-laid weights, the weights are not copied, and
        # inductor's on-disk graph cache (which freezing bypasses) makes later processes compile fast.
        def prefill(tokens, positions, rows, last_only):
            return self.model(tokens, positions, rows, last_only)

        def decode(tokens, positions, rows, last_only):
            return self.model(tokens, positions, rows, last_only)

        # Two functions, two dynamo caches: prefill's length is dynamic (marked on each call, so that
        # nothing else is), decode's shape never changes. Each runner gets its own code objects, since
        # dynamo caches per code object: other runners' graphs would count towards its recompile limit.
        prefill, decode = _own_code(prefill, id(self)), _own_code(decode, id(self))
        self._prefill_fn = torch.compile(prefill)
        options = decode_compile_options()  # keeps the weight-streaming loops lean; see decode_compile
        self._decode_fn = torch.compile(decode, dynamic=False, fullgraph=True, options=options)

    @torch.inference_mode()
    def _prefill(self, row: int, tokens: list[int], start: int, all_logits: bool) -> np.ndarray:
        t = torch.tensor([tokens], device=self.device)
        positions = torch.arange(start, start + len(tokens), device=self.device)[None]
        rows = torch.tensor([row], device=self.device)
        if self.mode == "eager" or len(tokens) == 1:  # dynamo would specialise a length of 1: eager
            logits = self._step(t, positions, rows, not all_logits)
        else:
            torch._dynamo.mark_dynamic(t, 1)
            torch._dynamo.mark_dynamic(positions, 1)
            logits = self._prefill_fn(t, positions, rows, not all_logits)
        return logits[0].cpu().numpy() if all_logits else logits[0, -1].cpu().numpy()

    @torch.inference_mode()
    def _decode(self, tokens: list[int], positions: list[int]) -> np.ndarray:
        t = torch.tensor(tokens, device=self.device)[:, None]
        p = torch.tensor(positions, device=self.device)[:, None]
        if self.mode == "cudagraphs":
            return self._replay(t, p)
        return self._decode_fn(t, p, self.all_rows, True)[:, 0].cpu().numpy()

    def _replay(self, tokens: torch.Tensor, positions: torch.Tensor) -> np.ndarray:
        """Capture the compiled decode step once into a CUDA graph, then replay it with new inputs."""
        if self._graph is None:
            self._static = (tokens.clone(), positions.clone())
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # compile and warm up outside the capture
                    self._decode_fn(*self._static, self.all_rows, True)
            torch.cuda.current_stream().wait_stream(stream)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._static_out = self._decode_fn(*self._static, self.all_rows, True)
        self._static[0].copy_(tokens)
        self._static[1].copy_(positions)
        self._graph.replay()
        return self._static_out[:, 0].cpu().numpy()

    def describe(self) -> dict:
        return {**super().describe(), "dtype": self.dtype, "device": str(self.device)}

    def peak_memory(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return max(torch.cuda.max_memory_reserved(self.device), total - free)
        return super().peak_memory()

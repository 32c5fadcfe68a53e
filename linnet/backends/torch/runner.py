"""Run the generated PyTorch source: eager, inductor (torch.compile) or CUDA graphs.

Shapes are fixed so that compilation happens once: decode always runs every cache row with one token
(one graph, no recompiles per step), and prefill is compiled once with a dynamic prompt length (a
mixture of experts' prompts run eager: ``eager_prompts``).
"""
from __future__ import annotations

import random
import sys
import time
import warnings
from collections.abc import Callable
from types import FunctionType, ModuleType
from typing import Any

import numpy as np
import torch

from linnet.backends import generated
from linnet.backends.runner import CacheShape, Runner
from linnet.backends.torch.codegen import generate_source
from linnet.backends.torch.setup import unavailable
from linnet.errors import BackendUnavailable, LinnetError
from linnet.program import (
    Program,
    block_forms,
    build_program,
    fold_norm_weights,
    fuse_norm_linears,
    fuse_projections,
    quantize_weights,
)
from linnet.program.ops import features
from linnet.quantize import K_QUANTS, MADE, block_names, check_form
from linnet.rope import rope_tables
from linnet.sampling import Sampling
from linnet.spec import ModelSpec
from linnet.weight_plan import WeightPlan, plan_weights
from linnet.weights import Weights

MODES = ("eager", "inductor", "cudagraphs")
CACHE_BUCKET = 256  # cache positions are allocated in multiples of this
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def torch_program(spec: ModelSpec, dtype: str = "f32", weight_dtype: str | None = None,
                  quantize: str = "none", weights: Weights | None = None, expert_blocks: bool = True) -> Program:
    """The program the torch backend runs. ``quantize``: "none"; a form (``linnet.quantize.FORMS``) for
    every matrix; or "gguf": each matrix as ``weights`` stores it where that is a block form (a GGUF file's).
    ``expert_blocks``: a mixture's expert stacks too (else widened at load, as compiled steps need them:
    ``TorchRunner``)."""
    program = fuse_norm_linears(fuse_projections(build_program(spec, dtype, weight_dtype)))
    # the forms its Blocks dequantise: MADE in its products, and a file's K-quant experts (eager's, whose
    # chosen experts alone are dequantised for their tokens)
    forms = block_forms(program, weights, quantize, stacks=(*MADE, *K_QUANTS) if expert_blocks else ())
    # A matrix in blocks keeps its values: its norm's weight multiplies x instead of being folded in.
    return quantize_weights(program, forms) if forms else fold_norm_weights(program)


def torch_weights(weights: Weights, program: Program) -> dict[str, torch.Tensor]:
    """The program's weight plan, carried out once (and cached) in NumPy, as tensors sharing its memory
    (a matrix in blocks: its uint8 block bytes)."""
    plan = WeightPlan.of(program)
    arrays = plan_weights(weights, plan)
    with warnings.catch_warnings():  # the arrays map a read-only file; the model never writes its weights
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: _tensor(array) for name, array in arrays.items()}


def _tensor(array: np.ndarray) -> torch.Tensor:
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16, which torch.from_numpy does not know
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def load_generated_module(source: str) -> ModuleType:
    return generated.load_generated_module(source, "torch")


def default_device(mode: str) -> str:
    reason = unavailable(mode)
    if reason:
        raise BackendUnavailable(f"torch:{mode} cannot run here: {reason}")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _own_code(fn: Callable[..., Any], tag: int) -> FunctionType:
    """fn with a code object of its own (the same code, renamed with tag)."""
    assert isinstance(fn, FunctionType)
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
        quantize: str | None = None,
    ):
        """``quantize``: "none"; a block form for every matrix (``linnet.quantize.FORMS``); "gguf": the
        matrices a GGUF file stores as Q8_0, Q4_0 or Q4_1, in those blocks; None (the default): "gguf" for
        torch:inductor on a CPU, whose decode step dequantises inside its loops, else "none" (eager would
        dequantise whole matrices at every step). Blocks run on the CPU only (docs/QUANTIZE.md)."""
        if mode not in MODES:
            raise LinnetError(f"unknown torch mode {mode!r}; choose from {', '.join(MODES)}")
        if dtype not in TORCH_DTYPES:
            raise LinnetError(f"unknown dtype {dtype!r}; choose from {', '.join(TORCH_DTYPES)}")
        super().__init__(weights.spec, cache)
        start = time.perf_counter()
        self.name = f"torch:{mode}"
        self.mode, self.dtype = mode, dtype
        self.device = torch.device(device or default_device(mode))
        if self.device.type == "cpu" and cache.chunk is None:
            # A CPU product of 16-bit weights widens each matrix once per call: a 512-token prompt of
            # Qwen2.5-0.5B's shapes in f16 took 1683 ms in two chunks, 1497 in one (f32: 1651, 1605).
            self.prefill_chunk = 512
        # A CPU's one-token products are bound by the bytes they read, and most CPUs lack fast 16-bit
        # arithmetic: there a 16-bit dtype means 16-bit weights widened inside the f32 product loops.
        self.act = dtype if self.device.type == "cuda" else "f32"
        if quantize is None:  # eager dequantises whole matrices at every step: 1.4 tok/s on SmolLM2
            quantize = "gguf" if self.device.type == "cpu" and mode == "inductor" else "none"
        if quantize not in ("none", "gguf"):
            check_form(quantize)
        if quantize != "none" and self.device.type != "cpu":
            raise LinnetError(f"--quantize {quantize}: weights in blocks run on the CPU only, "
                              f"not on {self.device.type}")
        # the real positions, bucketed, and the scratch one: a compiled step is built for one cache length,
        # so nearby lengths (another --max-new-tokens) share it
        bucketed = -(-cache.positions // CACHE_BUCKET) * CACHE_BUCKET
        # Inductor's decode loop over a gathered expert's blocks is not vectorised: on Granite 3B-A800M's
        # shapes in q8_0 it decoded at 2.52 tok/s against 21.85 for llama.cpp (docs/QUANTIZE.md), so
        # compiled modes widen the stacks at load; eager reads the chosen experts' blocks alone.
        program = self._with_rings(torch_program(weights.spec, self.act, dtype, quantize, weights,
                                                 expert_blocks=mode == "eager"), scratch=bucketed)
        self.quantized = sorted({form for _, _, form in program.quantized})
        # a mixture of experts' prompt groups its tokens by expert, a loop over data that torch.export cannot
        # trace: compiled modes run it eager, and compile the decode step (which gathers each token's experts)
        self.eager_prompts = "moe" in features(program)
        self.source = generate_source(program)
        module = load_generated_module(self.source)
        blocks = block_names(program.quantized, program.spec.num_layers)
        tensors = {name: module.Blocks(blocks[name], t) if name in blocks else t.to(self.device)
                   for name, t in torch_weights(weights, program).items()}
        cos, sin = rope_tables(weights.spec, bucketed + 1)
        self.model = module.Model(tensors, torch.from_numpy(cos), torch.from_numpy(sin), cache.rows,
                                  TORCH_DTYPES[self.act])
        self._prefill_fn, self._decode_fn = self.model, self.model
        # eager's products all take re-laid weights; a compiled step's one-row products stream the plain
        # ones, so it keeps both, and only where steps of several rows will use the re-laid (serving)
        compiled_rows = mode == "inductor" and cache.rows > 1
        self.prepacked = (mode == "eager" or compiled_rows) and _prepack_products(
            self.model, program, cache.rows, keep_plain=mode != "eager")
        if mode in ("inductor", "cudagraphs"):
            self._compile()
        self._graph: torch.cuda.CUDAGraph | None = None
        self.compile_time = 0.0  # seconds spent in the compiled steps' first calls (compiling or loading them)
        self.load_time = weights.load_time + time.perf_counter() - start

    def _compile(self) -> None:
        if self.mode == "inductor" and self.device.type == "cpu":
            # compiled once into AOTInductor packages on disk, which later processes load in milliseconds
            self._prefill_fn = self.model if self.eager_prompts else self._packaged("prompt step", True)
            self._decode_fn = self._packaged("decode step", False)
            return
        from linnet.backends.torch.decode_compile import decode_compile_options  # imports inductor

        # No freezing: the decode products need no re-laid weights, the weights are not copied, and
        # inductor's on-disk graph cache (which freezing bypasses) makes later processes compile fast.
        def prefill(tokens, positions, rows, select):
            return self.model(tokens, positions, rows, select)

        def decode(tokens, positions, rows, select):
            return self.model(tokens, positions, rows, select)

        # Two functions, two dynamo caches: prefill's length is dynamic (marked on each call, so that
        # nothing else is), decode's shape never changes. Each runner gets its own code objects, since
        # dynamo caches per code object: other runners' graphs would count towards its recompile limit.
        prefill, decode = _own_code(prefill, id(self)), _own_code(decode, id(self))
        compiled_prefill = self._noted(torch.compile(prefill), "prompt step")

        def prefill_any_length(tokens, positions, rows, select):
            torch._dynamo.mark_dynamic(tokens, 1)
            torch._dynamo.mark_dynamic(positions, 1)
            return compiled_prefill(tokens, positions, rows, select)

        self._prefill_fn = self.model if self.eager_prompts else prefill_any_length
        options = decode_compile_options()  # keeps the weight-streaming loops lean; see decode_compile
        decode = torch.compile(decode, dynamic=False, fullgraph=True, options=options)
        self._decode_fn = self._noted(decode, "decode step")

    def _packaged(self, what: str, dynamic: bool) -> Callable[..., Any]:
        """``what`` as AOTInductor packages (``aot``), one per shape (the prompt step: any length), each
        loaded, or built and kept, at its first call, which is timed into ``compile_time``."""
        from linnet.backends.torch import aot  # imports inductor

        steps: dict[tuple, Callable[..., Any]] = {}

        def call(tokens, positions, rows, select):
            shape = (tokens.shape[0], None if select is None else tuple(select.shape))
            if shape not in steps:
                start = time.perf_counter()
                steps[shape] = aot.load_or_build(self.model, self.source, (tokens, positions, rows, select), what,
                                                 dynamic, _note)
                self.compile_time += time.perf_counter() - start
            return steps[shape](tokens, positions, rows, select)

        return call

    def compiled_on_disk(self) -> bool:
        """Whether torch:inductor on a CPU finds this runner's prompt and one-row decode steps as packages
        on disk (so that it is ready in well under a second)."""
        from linnet.backends.torch import aot

        one = torch.zeros((1, 1), dtype=torch.int64)
        prompt = (torch.zeros((1, 2), dtype=torch.int64), torch.zeros((1, 2), dtype=torch.int64), one[0], one)
        decode = (one, one, one[0], None)
        steps = ((decode, False),) if self.eager_prompts else ((prompt, True), (decode, False))
        return (self.mode == "inductor" and self.device.type == "cpu"
                and all(aot.package_path(self.model, self.source, example, dynamic).is_file()
                        for example, dynamic in steps))

    def _noted(self, step: Callable[..., Any], what: str) -> Callable[..., Any]:
        """``step``, whose first call (where it compiles, or loads from inductor's cache) says so on stderr
        and is timed into ``compile_time``."""
        first = True

        def call(*args: Any) -> Any:
            nonlocal first
            if not first:
                return step(*args)
            first = False
            print(f"linnet: {self.name} is compiling its {what} (once per model, dtype and cache size; "
                  "minutes the first time, seconds once inductor has cached it)", file=sys.stderr, flush=True)
            start = time.perf_counter()
            out = step(*args)
            self.compile_time += time.perf_counter() - start
            return out

        return call

    @torch.inference_mode()
    def _forward(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray | None):
        t, p = torch.from_numpy(tokens).to(self.device), torch.from_numpy(positions).to(self.device)
        r = torch.from_numpy(rows).to(self.device)
        if tokens.shape[1] == 1 and select is None:  # a decode step, at one of decode_sizes()
            return self._replay(t, p, r) if self.mode == "cudagraphs" else self._decode_fn(t, p, r, None)
        s = None if select is None else torch.from_numpy(select).to(self.device)
        if self.mode == "eager" or tokens.shape[1] == 1:  # dynamo would specialise a length of 1: eager
            return self.model(t, p, r, s)
        # the length is marked dynamic in the torch.compile path only: importing torch._dynamo to mark it
        # took a second of a fresh `linnet run` that loads packages
        return self._prefill_fn(t, p, r, s)

    @torch.inference_mode()
    def _copy_cache(self, source: int, target: int, length: int) -> None:
        # in place: a compiled step, an AOT package or a captured CUDA graph keeps these tensors
        for cache in (*self.model.cache_k, *self.model.cache_v):
            span = self.copied_slots(cache.shape[2], length)
            cache[target, :, :span].copy_(cache[source, :, :span])

    @property
    def scratch_position(self) -> int:
        """The model's last position (its cache is allocated bucketed, + 1), so that eager attention, which
        reads up to the last position written, can tell idle rows' writes from a real row's."""
        return self.model.key_positions.shape[0] - 1

    def decode_sizes(self) -> tuple[int, ...]:
        # one CUDA graph, captured for every row
        return (self.cache.rows,) if self.mode == "cudagraphs" else super().decode_sizes()

    def _replay(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Capture the compiled decode step once into a CUDA graph, then replay it with new inputs."""
        if self._graph is None:
            self._static = (tokens.clone(), positions.clone(), rows.clone())
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # compile and warm up outside the capture
                    self._decode_fn(*self._static, None)
            torch.cuda.current_stream().wait_stream(stream)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._static_out = self._decode_fn(*self._static, None)
        for static, new in zip(self._static, (tokens, positions, rows)):
            static.copy_(new)
        self._graph.replay()
        return self._static_out

    # -- sampling on the device: only the chosen ids come back ----------------------------------------
    def _stack(self, picks: list[tuple[Any, int]]) -> torch.Tensor:
        return torch.stack([array[index, 0] for array, index in picks])

    def _to_host(self, array: Any) -> np.ndarray:
        return array.float().cpu().numpy()

    def _new_rng(self, seed: int | None) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(random.getrandbits(63) if seed is None else seed)

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, samplers: list[tuple[Sampling, Any]]) -> list[int]:
        chosen = logits.argmax(-1)
        for i, (sampling, generator) in enumerate(samplers):
            if not sampling.greedy:
                chosen[i] = draw(logits[i], sampling, generator)
        return chosen.cpu().tolist()

    def describe(self) -> dict:
        return {**super().describe(), "dtype": self.dtype, "arithmetic": self.act, "device": str(self.device),
                "threads": torch.get_num_threads(),
                **({"products": "oneDNN, weights re-laid at load"} if self.prepacked else {}),
                **({"blocks": ", ".join(self.quantized), "block_products": "dequantised in the product's loop"}
                   if self.quantized else {})}

    def peak_memory(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return max(torch.cuda.max_memory_reserved(self.device), total - free)
        return super().peak_memory()


def _prepack_products(model: torch.nn.Module, program: Program, rows: int, keep_plain: bool) -> bool:
    """Re-lay every f32 matrix product's weight for oneDNN once, at load (on a CPU); whether it did.
    oneDNN re-lays a plain weight at every call: SmolLM2's products of one layer and the head, 16 rows,
    took 14.5 ms as stored and 6.2 packed. Packed for ``rows`` rows, the serving engine's full step.
    Eager replaces each weight (a tied head gets a packed copy of its own, since the embedding's lookups
    need the table as it is). ``keep_plain`` (compiled steps, to which the packed tensors are opaque):
    each weight keeps its plain form and carries the packed one as its attribute ``onednn``, which the
    generated ``linnet::matmul_t`` uses (16 rows of Qwen2.5-0.5B's shapes, inductor: 166 against 108-125
    ms a decode step)."""
    if not (torch.backends.mkldnn.is_available() and model.embed.device.type == "cpu"):
        return False
    def products(section) -> set[str]:
        return {op.inputs[1].removeprefix("w.") for op in section.ops if op.kind in ("linear", "rms_linear")}

    layers = model.layers
    assert isinstance(layers, torch.nn.ModuleList)
    owners = [(block, name) for i, block in enumerate(layers) for name in products(program.layer_section(i))]
    owners += [(model, name) for name in products(program.head)]
    packed = False
    for owner, name in owners:
        weight = owner._buffers.get(name)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.dim() == 2:
            relaid = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            if keep_plain:
                weight.onednn = relaid  # type: ignore[attr-defined]  # a plain attribute the generated code reads
            else:
                owner._buffers[name] = relaid
            packed = True
    return packed


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def draw(logits: torch.Tensor, s: Sampling, generator: torch.Generator) -> torch.Tensor:
    """One token from a row of logits as ``linnet.sampling.sample_host`` defines it, on the logits' device."""
    scores = logits.double()
    scores = (scores - scores.max()) / s.temperature  # shifted first: a tiny temperature must not overflow
    if s.top_k and s.top_k < scores.numel():
        cutoff = torch.topk(scores, s.top_k).values[-1]
        scores = torch.where(scores >= cutoff, scores, float("-inf"))
    probs = torch.softmax(scores, -1)
    if s.top_p < 1.0:
        ranked, order = probs.sort(descending=True, stable=True)
        before = ranked.cumsum(0) - ranked  # mass of the tokens ranked above each one
        probs[order[before >= s.top_p]] = 0.0
        probs /= probs.sum()
    return torch.multinomial(probs, 1, generator=generator)[0]

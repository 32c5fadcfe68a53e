"""Run the step's ONNX graph with ONNX Runtime, the KV cache kept where the provider runs.

The session is built once at load from graph files kept in Linnet's cache (written on the first load of
a model, dtype and variant). Each layer's cache is one buffer on the provider's device, bound with I/O
binding as both the step's input and its output: ScatterND writes the new keys and values into it in
place, and nothing of the cache crosses to the host. The graph's ArgMax brings back only token ids for
greedy rows; a sampled row's logits come to the host for ``linnet.sampling``.

On the CPU provider attention is GroupQueryAttention (``graph.GraphOptions.attention``): it appends at
each row's length and reads only the valid part of the cache, but its batch is the cache buffer's rows
in order. So the caches are host arrays, and a step binds the window of cache rows from its lowest row
to its highest (views: nothing is copied), the window's rows the step does not name writing the scratch
position, as idle rows do. A prompt chunk is a window of one row; a decode step over the engine's rows
(filled from row 0) is the rows it runs, and no more (``decode_sizes``). Several rows' prompts from
position 0 are one batch (``_first_prompts``); speculation's checks of several rows' chunks after their
pasts are one ragged call over their rows' window, the products on the chunks' own tokens (``verify``;
padded, a call a run of consecutive rows, where the program has ring layers); other steps of several
tokens in several rows go a row at a time. A step must place each row's tokens contiguously;
one that does not (the warm-up's tokens at the scratch position) runs a token at a time, in order of
position, which is the same step: a query attends to positions up to its own, which the earlier tokens
have written.

On the CPU provider a GGUF file's matrices in llama.cpp's blocks stay in them by default
(``quantize``): ONNX Runtime multiplies them in integers, as llama.cpp does (``blocks``, docs/ONNX.md).
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from linnet.backends.onnx import blocks, contrib, export, graph, lower, passes
from linnet.backends.onnx.export import onnx_program, planned_arrays, write_graphs
from linnet.backends.onnx.graph import GraphOptions
from linnet.backends.onnx.setup import PROVIDERS, threads, unavailable
from linnet.backends.runner import CacheShape, Runner
from linnet.dtypes import DTYPES
from linnet.errors import BackendUnavailable, LinnetError
from linnet.files import atomic_write
from linnet.program import Program
from linnet.quantize import check_form
from linnet.sampling import Sampling, sample_host
from linnet.spec import ModelSpec
from linnet.weight_cache import cache_root, code_identity, keep_within_budget, used
from linnet.weights import Weights

DEVICES = {"cpu": "cpu", "cuda": "cuda", "tensorrt": "cuda"}
GRAPH_FILE = "model.onnx"
# GroupQueryAttention's CPU kernel has a flash path (read from the environment when a session is built)
# that ran slower on 2 cores of an Intel Xeon: a 256-token prompt's attention 62-86 against 33-53 ms, a
# 16-row decode step's 22.8 against 15.3 ms on Qwen2.5-0.5B's shapes (docs/NOTEBOOK.md, 2026-12-02). The
# CPU sessions are built without it, unless the variable is set already.
GQA_FLASH_OFF = {"ORT_GQA_DISABLE_FLASH_ATTENTION": "1"}
PAGE_VALUES = 1024  # values of 4 bytes or fewer in a 4 KiB page: writing one of each maps the page


def graph_options(mode: str, dtype: str, spec: ModelSpec, cache: CacheShape) -> GraphOptions:
    """The graph a provider runs best: contrib ops for ONNX Runtime's own kernels, plain ONNX for
    TensorRT (which parses standard operators only); bfloat16 on the CPU provider, which has no
    bfloat16 products, held in float32 and rounded to bfloat16 after every op; GroupQueryAttention
    on the CPU provider (whose kernel takes head sizes in multiples of 8)."""
    variant = "plain" if mode == "tensorrt" else "ort"
    gqa = mode == "cpu" and spec.head_dim % 8 == 0
    return GraphOptions(variant, "f32" if (mode == "cpu" and dtype == "bf16") else None, "gqa" if gqa else "gather",
                        ragged=gqa)


@dataclass
class StepOutput:
    logits: Any  # [R, S, vocab] f32: an OrtValue on the provider's device, or a host array
    ids: np.ndarray  # [R, S] i64: each selected token's argmax
    index: np.ndarray | None = None  # the step's rows within ``logits`` (a window's), if not all in order

    def host_logits(self) -> np.ndarray:
        logits = self.logits if isinstance(self.logits, np.ndarray) else self.logits.numpy()
        return logits if self.index is None else logits[self.index]


class OnnxRunner(Runner):
    prompts_together = True  # several rows' short prompts a call (``Runner.prompt_groups``)

    def __init__(self, weights: Weights, cache: CacheShape = CacheShape(), dtype: str = "f32", mode: str = "cpu",
                 quantize: str | None = None):
        """``quantize``: "none"; a block form for every matrix (``linnet.quantize.MADE``); "gguf": the
        matrices a GGUF file stores as Q8_0, Q4_0, Q4_1, Q4_K or Q6_K, in those blocks; None (the
        default): "gguf" on the CPU provider, else "none". Blocks run through ONNX Runtime's MatMulNBits
        on the CPU provider."""
        if mode not in PROVIDERS:
            raise LinnetError(f"unknown onnx mode {mode!r}; choose from {', '.join(PROVIDERS)}")
        reason = unavailable(mode)
        if reason:
            raise BackendUnavailable(f"onnx:{mode} cannot run here: {reason}")
        super().__init__(weights.spec, cache)
        start = time.perf_counter()
        self.name, self.mode, self.dtype = f"onnx:{mode}", mode, dtype
        # a chunk that draws no token selects none, and skips the head (``Runner.reads_without_logits``);
        # on the CPU provider, where it was measured; GPU providers keep one (no empty shape tried there)
        self.reads_without_logits = mode == "cpu"
        self.device = DEVICES[mode]
        self.options = graph_options(mode, dtype, weights.spec, cache)
        if quantize is None:
            quantize = "gguf" if mode == "cpu" else "none"
        if quantize not in ("none", "gguf"):
            check_form(quantize)
        if quantize != "none" and mode != "cpu":
            raise LinnetError(f"--quantize {quantize}: onnx runs weights in blocks on the CPU provider only, "
                              f"not onnx:{mode}")
        program = self._with_rings(onnx_program(weights.spec, dtype, weights, quantize))
        self._slots = [program.cache_slots(kind, cache.positions) for kind in program.layer_kinds]  # each layer's
        self.quantized = sorted({form for _, _, form in program.quantized})
        self._expert_blocks = any(name == "expert_down" for _, name, _ in program.quantized)
        self._kept: tempfile.TemporaryDirectory | None = None
        path = self._graph_file(weights, program, max(weights.spec.max_positions, cache.positions + 1))
        self.session = self._session(path)
        # checks of several rows' chunks of different lengths run their own tokens only, where every layer's
        # attention is GroupQueryAttention (a ring layer's reads the step's rows: ``verify``)
        self.ragged_checks = self.options.ragged and not self.rings
        self._bind_caches()
        self.load_time = weights.load_time + time.perf_counter() - start

    def kept_cache_dtype(self, program: Program) -> str:
        return self.options.compute or program.cache_dtype  # bfloat16 on the CPU: held in float32

    # -- load ------------------------------------------------------------------------------------
    def _graph_file(self, weights: Weights, program: Program, rope_positions: int) -> Path:
        """The graph and its weights on disk, written on the first load and kept in Linnet's cache."""
        rings = f"|rings {sorted(self.rings)}, scratch {self.scratch_position}" if self.rings else ""
        key = (f"{weights.source}|{self.dtype}|{self.options}|{program.quantized}|{rope_positions}|"
               f"{code_identity(graph, lower, contrib, passes, export, blocks)}{rings}")
        float_type = DTYPES[self.options.compute or self.dtype].numpy

        def write(directory: Path) -> None:
            directory.mkdir(parents=True)
            write_graphs(program, planned_arrays(weights, program, float_type), directory, rope_positions,
                         {GRAPH_FILE: self.options})

        if weights.source is None:  # weights made in memory: nothing to key a cache by
            self._kept = tempfile.TemporaryDirectory(prefix="linnet-onnx-")
            write(Path(self._kept.name) / "graph")
            return Path(self._kept.name) / "graph" / GRAPH_FILE
        directory = cache_root() / "onnx" / hashlib.sha256(key.encode()).hexdigest()[:24]
        if not (directory / GRAPH_FILE).is_file():
            atomic_write(directory, write)
            keep_within_budget(directory)
        used(directory)
        return directory / GRAPH_FILE

    def _session(self, path: Path) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads()
        options.inter_op_num_threads = 1
        if self.mode == "cpu":
            # Parallel loops hand out work in shrinking blocks that idle threads take, rather than one share
            # a thread: a thread the OS preempts (for the HTTP server, or a client on the same cores) then
            # delays the step less. linnet serve, 2 threads: +5% tokens/s, four pairs taking turns.
            options.add_session_config_entry("session.dynamic_block_base", "4")
        options.log_severity_level = 3  # warnings about the optimizer's own choices are not the user's
        provider = PROVIDERS[self.mode]
        providers: list[Any] = [provider]
        if self.mode == "tensorrt":  # engines are built once and kept beside the graph
            engines = path.parent / "tensorrt"
            providers = [(provider, {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(engines),
                                     "trt_fp16_enable": self.dtype == "f16", "trt_bf16_enable": self.dtype == "bf16"}),
                         "CUDAExecutionProvider"]
        try:
            with _environment(GQA_FLASH_OFF if self.mode == "cpu" else {}):
                return ort.InferenceSession(str(path), options, providers=providers)
        except Exception as e:  # onnxruntime raises its own classes, each with the failing node in the text
            raise LinnetError(self._load_error(str(e))) from None

    def _load_error(self, message: str) -> str:
        missing = re.search(r"Could not find an implementation for (\w+)\((\d+)\)", message)
        if missing:
            op, version = missing.groups()
            other = [d for d in ("f32", "f16") if d != self.dtype]
            return (f"onnx:{self.mode}: ONNX Runtime's {PROVIDERS[self.mode]} has no {self.dtype} kernel for "
                    f"{op} (opset {version}); the nearest that runs: --dtype {' or '.join(other)}")
        return f"onnx:{self.mode}: ONNX Runtime could not build the session: {message.splitlines()[0]}"

    def _bind_caches(self) -> None:
        """Each layer's cache: one zeroed buffer on the device, bound as input and output of every step."""
        spec = self.spec
        dtype = DTYPES[self.options.compute or self.dtype].numpy
        self.binding = self.session.io_binding()
        self._bind_results()  # first: a rebound name keeps its place, so the results stay outputs 0 and 1
        self.cache_names = [i.name for i in self.session.get_inputs() if i.name.startswith("cache_")]
        # each "cache_k.<layer>": every position and the scratch one, or a ring's slots and its scratch slot
        shapes = [(self.cache.rows, spec.num_kv_heads, self._slots[int(name.split(".")[1])], spec.head_dim)
                  for name in self.cache_names]
        if self.options.attention == "gqa":  # host arrays, bound a window of rows at a time (_window)
            self.caches = [np.zeros(shape, dtype) for shape in shapes]
            self._bound: tuple[int, int] | None = None
            # where first prompts of rows that are not consecutive are read (_on_scratch), kept between calls:
            # a buffer allocated per call is pages to fault in on every call
            self._scratch = [np.empty(0, dtype) for _ in self.cache_names]
            return
        self.caches = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype), self.device, 0) for shape in shapes]
        self._bind_cache_values(self.caches)

    def _bind_cache_values(self, values: list[Any]) -> None:
        for name, value in zip(self.cache_names, values):
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(f"{name}.out", value)

    def decode_sizes(self) -> tuple[int, ...]:
        """Every number of rows on the CPU provider, which compiles nothing per shape: padded to the next
        power of 4, a step of 5 busy rows of 16 took 40-42 ms against 16-17 as 5, of 8 38 against 21, of 2 of
        4 15 against 11-12 (SmolLM2's Q4_1 file, 2 threads, 2026-12-08). TensorRT builds an engine per shape
        and the CUDA provider was not measured: powers of 4 there (``Runner.decode_sizes``)."""
        return tuple(range(1, self.cache.rows + 1)) if self.mode == "cpu" else super().decode_sizes()

    def warmed_decode_sizes(self) -> tuple[int, ...]:
        """The largest decode step only on the CPU provider: it compiles nothing, and the largest step grows
        its buffers for the others."""
        return (self.cache.rows,) if self.mode == "cpu" else super().warmed_decode_sizes()

    def warm_up(self, verify: tuple[int, int] | None = None) -> float:
        """The runner's warm-up and, with the caches on the host (GroupQueryAttention), first prompts of up
        to a prompt chunk read on the scratch caches, and every page of the caches written once with the
        values it holds: a fresh server's first burst of prompts then finds ONNX Runtime's buffers grown
        and the cache's pages mapped, rather than paying both in its first tokens. No row changes."""
        seconds = super().warm_up(verify)
        if self.options.attention != "gqa":
            return seconds
        start = time.perf_counter()
        count = min(4, self.cache.rows)
        width = min(self.prefill_chunk // count, self.cache.positions)  # within the rotary tables
        tokens = np.zeros((count, width), np.int64)
        positions = np.tile(np.arange(width, dtype=np.int64), (count, 1))
        self._on_scratch(tokens, positions, np.arange(count, dtype=np.int64), positions[:, -1:])
        for cache in self.caches:
            flat = cache.reshape(-1)
            flat[::PAGE_VALUES] = flat[::PAGE_VALUES].copy()
        return seconds + time.perf_counter() - start

    # -- the step --------------------------------------------------------------------------------
    def _forward(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray | None):
        if select is None:
            select = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int64), tokens.shape)
        if self.options.attention != "gqa":
            return self._run(tokens, positions, rows, select)
        if tokens.shape[1] > 1 and len(rows) > 1:
            if not positions[:, 0].any():  # first prompts: one batch (``_first_prompts``)
                return self._first_prompts(tokens, positions, rows, select)
            if all(_contiguous(p) for p in positions):  # chunks after a past (``Runner.verify``)
                return self._in_runs(tokens, positions, rows, select)
            return _stacked([self._forward(tokens[i:i + 1], positions[i:i + 1], rows[i:i + 1], select[i:i + 1])
                             for i in range(len(rows))])
        if not _contiguous(positions[0]):
            return self._forward_each(tokens, positions, rows, select)
        return self._window(tokens, positions, rows, select)

    def _copy_cache(self, source: int, target: int, length: int) -> None:
        for cache in self.caches:
            if isinstance(cache, np.ndarray):  # host arrays, bound as views (GroupQueryAttention)
                span = self.copied_slots(cache.shape[2], length)
                cache[target, :, :span] = cache[source, :, :span]
            else:  # a buffer on the provider's device, bound in place: copied through the host
                host = cache.numpy()
                span = self.copied_slots(host.shape[2], length)
                host[target, :, :span] = host[source, :, :span]
                cache.update_inplace(host)

    def _in_runs(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray) -> StepOutput:
        """Several rows' chunks that follow their pasts: a call for each run of consecutive rows, its window
        of the cache (GroupQueryAttention appends a chunk to every row it is given, so a row between two
        of the call's would be written too)."""
        order = np.argsort(rows, kind="stable")
        runs = np.split(order, np.flatnonzero(np.diff(rows[order]) != 1) + 1)
        if len(runs) == 1:
            return self._consecutive(order, tokens, positions, rows, select)
        steps = [(run, self._window(tokens[run], positions[run], rows[run], select[run])) for run in runs]
        hosts = [(run, step.host_logits(), step.ids) for run, step in steps]
        logits = np.empty((len(rows), *hosts[0][1].shape[1:]), np.float32)
        ids = np.empty(select.shape, np.int64)
        for run, host, step_ids in hosts:
            logits[run], ids[run] = host, step_ids
        return StepOutput(logits, ids)

    def _consecutive(self, order: np.ndarray, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray,
                     select: np.ndarray) -> StepOutput:
        """A step of consecutive rows given in any order (``order`` sorts them): their window, each given
        row's logits and ids at its place in it."""
        out = self._window(tokens[order], positions[order], rows[order], select[order])
        where = np.argsort(order)  # each given row's place in the window
        return StepOutput(out.logits, out.ids[where], where)

    def _forward_each(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray):
        """A one-row step with scattered positions, a token at a time in order of position."""
        steps = {}
        for t in np.argsort(positions[0], kind="stable"):
            steps[t] = self._window(tokens[:, t:t + 1], positions[:, t:t + 1], rows, np.zeros((1, 1), np.int64))
        logits = np.stack([steps[t].host_logits()[:, 0] for t in select[0]], axis=1)
        return StepOutput(logits, np.stack([steps[t].ids[:, 0] for t in select[0]], axis=1))

    def _first_prompts(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray):
        """Several rows' prompts from position 0, as one batch. Consecutive rows (in any order) are their
        window of the cache; others are written into a scratch cache of the prompts' length, then copied
        into them."""
        order = np.argsort(rows)
        if (rows[order] == rows[order[0]] + np.arange(len(rows))).all():
            return self._consecutive(order, tokens, positions, rows, select)
        out, scratch = self._on_scratch(tokens, positions, rows, select)
        for cache, written in zip(self.caches, scratch):
            cache[rows, :, :tokens.shape[1]] = written
        return out

    def _on_scratch(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray,
                    select: np.ndarray) -> tuple[StepOutput, list[np.ndarray]]:
        """First prompts read into the scratch caches (as many rows as ``rows``, as many positions as the
        prompts' width) bound in place of the cache; the step and each layer's scratch it wrote."""
        count, width = tokens.shape
        shape = (count, self.spec.num_kv_heads, width, self.spec.head_dim)
        size = int(np.prod(shape))
        if size > self._scratch[0].size:  # grown to the largest call yet (the warm-up's, at start)
            self._scratch = [np.empty(size, c.dtype) for c in self.caches]
        scratch = [s[:size].reshape(shape) for s in self._scratch]
        self._bind_cache_values([ort.OrtValue.ortvalue_from_numpy(s) for s in scratch])
        self._bound = None
        return self._run(tokens, positions, np.arange(count, dtype=np.int64), select), scratch

    def verify(self, chunks: Mapping[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """``Runner.verify``; where the chunks differ in length or their rows are apart, and the graph is ragged
        (``ragged_checks``), one call over the window of their rows computes their own tokens only:
        GroupQueryAttention alone pads each of the window's rows to the longest chunk
        (``passes.gathered_attention``), not every product."""
        if not self.ragged_checks or len(chunks) < 2:
            return super().verify(chunks)
        self._check_verify(chunks)
        width = max(len(chunk) for chunk in chunks.values())
        first, last = min(chunks), max(chunks) + 1
        if any(self.lengths[row] + width > self.cache.positions for row in range(first, last)):
            return super().verify(chunks)  # padding past a row's cache
        return self._ragged_window(first, last, chunks)

    def _ragged_window(self, first: int, last: int, chunks: Mapping[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """The chunks of rows ``first``..``last`` in one call: the step's tokens are the chunks one after another
        (one row of their sum), GroupQueryAttention's rows the window's, each padded to the longest chunk; a
        window row without a chunk (idle, or decoding apart) reads no token of its own, and its padding writes
        positions past its length, which no query reads before they are written again."""
        window = range(first, last)
        sizes = np.array([len(chunks.get(row, ())) for row in window])
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        width, total = int(sizes.max()), int(sizes.sum())
        lengths = np.array([self.lengths[row] for row in window], dtype=np.int64)
        tokens = np.concatenate([np.asarray(chunks[row], dtype=np.int64) for row in window if row in chunks])[None]
        positions = np.concatenate([length + np.arange(size) for length, size in zip(lengths, sizes)])[None]
        slots = np.clip(starts[:, None] + np.minimum(np.arange(width), sizes[:, None] - 1), 0, total - 1)
        unpack = np.stack([np.zeros_like(slots), slots], axis=-1)  # a row's padding repeats its last token
        pack = np.stack([np.repeat(np.arange(len(window)), sizes), np.arange(total) - np.repeat(starts, sizes)], -1)
        self._bind_window(first, last)
        out = self._run(tokens, positions, np.zeros(1, np.int64), np.arange(total)[None],
                        (lengths[:, None] + np.arange(width), unpack, pack[None]))
        logits = self._to_host(out)[0]
        return {row: logits[start:start + size] for row, start, size in zip(window, starts, sizes) if row in chunks}

    def _bind_window(self, first: int, last: int) -> None:
        if self._bound != (first, last):
            self._bind_cache_values([ort.OrtValue.ortvalue_from_numpy(c[first:last]) for c in self.caches])
            self._bound = (first, last)

    def _window(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray) -> StepOutput:
        """The step on the cache rows min(rows)..max(rows), bound as views; the window's other rows idle.
        The step's rows are the window's (a ring layer's ScatterND and Gather read them; GroupQueryAttention
        takes the bound rows in order)."""
        first, last = int(rows.min()), int(rows.max()) + 1
        self._bind_window(first, last)
        slot = rows - first
        if last - first == len(rows) and (slot == np.arange(len(rows))).all():
            return self._run(tokens, positions, slot, select)
        size = last - first  # several tokens a row come in runs of consecutive rows: ``_in_runs``
        full_tokens = np.zeros((size, 1), np.int64)
        full_positions = np.full((size, 1), self.scratch_position, np.int64)
        full_select = np.zeros((size, select.shape[1]), np.int64)
        full_tokens[slot], full_positions[slot], full_select[slot] = tokens, positions, select
        out = self._run(full_tokens, full_positions, np.arange(size, dtype=np.int64), full_select)
        return StepOutput(out.logits, out.ids[slot], slot)

    def _run(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray,
             ragged: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> StepOutput:
        """The graph on these inputs; a ragged graph's attention rows are the step's own unless ``ragged``
        (``gqa_positions``, ``unpack``, ``pack``) says otherwise (``_ragged_window``)."""
        inputs = {"tokens": tokens, "positions": positions, "rows": rows, "select": select}
        if self.options.ragged:
            places = np.moveaxis(np.indices(tokens.shape), 0, -1)  # each token's own (r, t)
            inputs.update(zip(("gqa_positions", "unpack", "pack"), ragged or (positions, places, places)))
        for name, array in inputs.items():
            self.binding.bind_cpu_input(name, np.ascontiguousarray(array, dtype=np.int64))
        self._bind_results()
        self.session.run_with_iobinding(self.binding)
        logits, ids = self.binding.get_outputs()[:2]
        return StepOutput(logits, ids.numpy())

    def _bind_results(self) -> None:
        """Fresh buffers for each step's results: a step's logits outlive the next step's."""
        self.binding.bind_output("logits", self.device)
        self.binding.bind_output("next_ids", "cpu")  # only the ids cross to the host

    def _stack(self, picks: list[tuple[StepOutput, int]]) -> list[tuple[StepOutput, int]]:
        return picks  # each row's logits stay where they are until a row needs them

    def _to_host(self, array: Any) -> np.ndarray:
        if isinstance(array, StepOutput):
            return array.host_logits()
        return np.stack([step.host_logits()[index, 0] for step, index in array])

    def _sample(self, picks: list[tuple[StepOutput, int]], samplers: list[tuple[Sampling, Any]]) -> list[int]:
        return [int(step.ids[index, 0]) if sampling.greedy else
                sample_host(step.host_logits()[index, 0], sampling, rng)
                for (step, index), (sampling, rng) in zip(picks, samplers)]

    def describe(self) -> dict:
        return {**super().describe(), "dtype": self.dtype, "provider": PROVIDERS[self.mode],
                "graph": self.options.variant, "attention": self.options.attention, "threads": threads(),
                **({"blocks": ", ".join(self.quantized), "block_products": "activations rounded to int8, integer "
                    "products (MatMulNBits" + (", QMoE for the experts)" if self._expert_blocks else ")")}
                   if self.quantized else {})}


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """Set the variables not set already, for the block only."""
    added = {name: value for name, value in variables.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _stacked(steps: list[StepOutput]) -> StepOutput:
    """Steps of one row each as one step of their rows, in order."""
    return StepOutput(np.concatenate([s.host_logits() for s in steps]), np.concatenate([s.ids for s in steps]))


def _contiguous(positions: np.ndarray) -> bool:
    return bool((positions == positions[0] + np.arange(len(positions))).all())

"""The compiled backends' mixtures of experts are sparse: a step computes with the experts its tokens chose
and no other. On every backend, experts no token of a run chose are NaN in the checkpoint and the logits
are the reference's (a dense form, every expert on every token weighted by 0, would be NaN); then each
backend's own evidence of what it reads: xla:jax's generated code counted through the stacks it indexes,
xla:stablehlo's module read for its slices of the stacks, ONNX Runtime's profile of the plain graph's
expert loop and the MoE kernel of the ort graph, and the exported graph of torch:inductor's decode step.
Last, the serving engine's batched steps on these models."""
from __future__ import annotations

import collections
import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from checkpoints import Case, build_checkpoint
from safetensors.numpy import load_file, save_file
from test_moe import hf_choices, sparse_layers

from linnet.backends import CacheShape, create_runner
from linnet.backends.onnx.export import write as write_onnx
from linnet.backends.registry import get_backend
from linnet.backends.xla.layout import xla_program
from linnet.backends.xla.runner import load_generated_module
from linnet.backends.xla.stablehlo import Sizes, emit_module, weight_shapes
from linnet.model import open_model
from linnet.program import build_program

# 16 experts, 2 a token, beside a shared expert; a dense layer between the two sparse ones: a short run
# leaves most experts unchosen
WIDE = Case("qwen2moe-top2of16", "Qwen2MoeForCausalLM", dict(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=16, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=40, mlp_only_layers=[1]))
STACKS = ("expert_gate", "expert_up", "expert_down")
PROMPT = [17, 250, 3, 99, 42, 7, 300, 12, 5, 61, 140, 8]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    return build_checkpoint(WIDE, tmp_path_factory.mktemp(WIDE.id))


def two_rows(runner) -> tuple[list[np.ndarray], list[list[int]]]:
    """Rows 0 and 1 each take a one-token prompt, then one decode step together: each step's logits, and
    each row's tokens."""
    firsts = (17, 250)
    logits = [np.asarray(runner.prefill(row, [token])) for row, token in enumerate(firsts)]
    nexts = [int(step.argmax()) for step in logits]
    logits.append(np.asarray(runner.decode(nexts)))
    return logits, [[token, n] for token, n in zip(firsts, nexts)]


def chosen_experts(directory: Path, runs: list[list[int]]) -> list[set[int]]:
    """Per sparse layer, the experts transformers' router chose for any token of ``runs``."""
    per_run = [hf_choices(directory, ids) for ids in runs]
    return [{int(e) for choices in layer for e in choices.flatten()} for layer in zip(*per_run)]


def poisoned(directory: Path, out: Path, keep: dict[int, set[int]]) -> Path:
    """A copy of the checkpoint whose experts, in each layer of ``keep``, outside its set hold NaN."""
    out.mkdir()
    for f in directory.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(directory / "model.safetensors")
    for name, array in tensors.items():
        found = re.match(r"model\.layers\.(\d+)\..*\.experts\.(?:(\d+)\.)?", name)
        if not found:
            continue
        kept = keep[int(found[1])]
        if found[2] is not None:  # one tensor per expert
            if int(found[2]) not in kept:
                array[...] = np.nan
        else:  # a stack, experts first
            array[[e for e in range(array.shape[0]) if e not in kept]] = np.nan
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def unchosen_nan(wide, tmp_path_factory) -> tuple[list[np.ndarray], Path]:
    """The reference's logits of ``two_rows``, and the checkpoint whose experts no token of it chose are NaN."""
    want, runs = two_rows(create_runner("reference:numpy", open_model(str(wide)).weights, CacheShape(2, 16)))
    sparse = [i for i, kind in enumerate(build_program(open_model(str(wide)).spec).layer_kinds) if "-dense" not in kind]
    keep = dict(zip(sparse, chosen_experts(wide, runs)))
    assert sparse == [0, 2] and all(len(experts) <= 8 for experts in keep.values())  # half the experts or more NaN
    return want, poisoned(wide, tmp_path_factory.mktemp("nan") / "checkpoint", keep)


@pytest.mark.parametrize("backend", ["torch:eager", "torch:inductor", "xla:jax", "xla:stablehlo", "onnx:cpu"])
def test_experts_no_token_chose_never_enter_a_step(unchosen_nan, backend):
    reason = get_backend(backend).unavailable()
    if reason:
        pytest.skip(reason)
    want, checkpoint = unchosen_nan
    # chunks of one token: XLA pads a prompt to its chunk, and padding routes to experts of its own
    got, _ = two_rows(create_runner(backend, open_model(str(checkpoint)).weights, CacheShape(2, 16, chunk=1)))
    for g, w in zip(got, want):
        assert np.isfinite(g).all() and np.abs(g - w).max() <= 1e-4


# -- each backend's own evidence ----------------------------------------------------------------------------

class StackReads:
    """An expert stack the generated JAX reads through, under jax.disable_jit (its loops run in Python):
    counts each expert indexed out of it; it is no array, so any other use of the whole stack fails."""

    def __init__(self, array, key: tuple[int, str], reads: collections.Counter):
        self.array, self.key, self.reads = array, key, reads

    def __getitem__(self, e):
        self.reads[(*self.key, int(e))] += 1
        return self.array[e]


def test_xla_jax_reads_each_chosen_expert_once_a_step(wide):
    """A prompt, then a decode step of two rows whose tokens chose different experts: each expert some
    token chose is read once a step (whatever the tokens that chose it), and no other."""
    runner = create_runner("xla:jax", open_model(str(wide)).weights, CacheShape(2, 32, chunk=len(PROMPT)))
    module, sparse = load_generated_module(runner.source), sparse_layers(runner)

    def step(tokens: list[list[int]], positions: list[list[int]], rows: list[int]) -> tuple[collections.Counter, list]:
        """The generated step, un-jitted, on the runner's caches: the reads, and each row's next token."""
        reads: collections.Counter = collections.Counter()
        weights = {**runner.weights, "layers": [
            {**layer, **{name: StackReads(layer[name], (i, name), reads) for name in STACKS if name in layer}}
            for i, layer in enumerate(runner.weights["layers"])]}
        inputs = [np.array(a, np.int32) for a in (tokens, positions, rows, [[len(tokens[0]) - 1]] * len(rows))]
        with jax.disable_jit():
            logits, runner.cache_k, runner.cache_v = module.step(weights, runner.cache_k, runner.cache_v,
                                                                 *runner.rope, *inputs)
        return reads, np.asarray(logits)[:, -1].argmax(-1).tolist()

    def experts(reads: collections.Counter) -> list[set[int]]:
        assert set(reads.values()) == {1} and {(i, name) for i, name, _ in reads} == {
            (i, name) for i in sparse for name in STACKS}
        return [{e for i, name, e in reads if i == layer and name == STACKS[0]} for layer in sparse]

    reads, (first,) = step([PROMPT], [list(range(len(PROMPT)))], [0])
    assert experts(reads) == chosen_experts(wide, [PROMPT])
    second = [5, 9, 300]
    nexts = [first, int(runner.prefill(1, second).argmax())]
    reads, _ = step([[nexts[0]], [nexts[1]]], [[len(PROMPT)], [len(second)]], [0, 1])
    decoded = experts(reads)
    want = [a | b for a, b in zip(*(({int(e) for e in c[-1]} for c in hf_choices(wide, ids))
                                   for ids in (PROMPT + [nexts[0]], second + [nexts[1]])))]
    assert decoded == want and all(len(e) < 16 for e in want)


def test_xla_stablehlo_reads_a_stack_by_the_expert_loops_slice_alone(wide):
    """In the decode and prompt modules, each expert stack is read by one dynamic slice of one expert, at
    the index the expert loop carries (its first argument), the loop visiting the chosen experts."""
    program = xla_program(open_model(str(wide)).spec)
    stacks = [name for name, _ in weight_shapes(program) if name.split(".")[-1] in STACKS]
    assert len(stacks) == 6
    for sizes in (Sizes(2, 1, 1, 2, 33), Sizes(1, 12, 1, 2, 33)):
        text = emit_module(program, sizes, "step")
        for name in stacks:
            uses = [line for line in text.splitlines() if f"%{name}," in line or f"%{name} " in line]
            assert len(uses) == 1 and re.search(rf"stablehlo\.dynamic_slice %{re.escape(name)}, %w\d+_0, %v\d+, "
                                                rf"%v\d+, sizes = \[1, \d+, \d+\]", uses[0]), uses


def test_onnx_runs_each_expert_once_on_its_tokens_and_the_ort_graph_calls_the_moe_kernel(wide, tmp_path):
    """The plain graph's expert loop, profiled by ONNX Runtime over a prompt: in each sparse layer, the
    gate, up and down products ran once per expert some token chose. The ort graph gives each sparse layer
    to com.microsoft MoE, which runs each expert on its tokens (the NaN test above), and reads the
    Program's gate and up stacks nowhere (the kernel takes them interleaved)."""
    model = open_model(str(wide))
    write_onnx(model, tmp_path, "f32")
    plain = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    loops = [node for node in plain.graph.node if node.op_type == "Loop"]
    products = [[n.name for n in loop.attribute[0].g.node if n.op_type == "Gemm"] for loop in loops]
    assert [len(p) for p in products] == [3, 3]  # gate, up, down in each sparse layer

    options = ort.SessionOptions()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), options, providers=["CPUExecutionProvider"])
    spec, n = model.spec, len(PROMPT)
    feeds = {"tokens": np.array([PROMPT]), "positions": np.arange(n)[None], "rows": np.array([0]),
             "select": np.array([[n - 1]])}
    for i in range(spec.num_layers):
        feeds[f"cache_k.{i}"] = feeds[f"cache_v.{i}"] = np.zeros((1, spec.num_kv_heads, 16, spec.head_dim), np.float32)
    session.run(["logits"], feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    ran = collections.Counter(e["name"].removesuffix("_kernel_time") for e in events if e.get("cat") == "Node")
    want = [[len(experts)] * 3 for experts in chosen_experts(wide, [PROMPT])]  # gate, up, down: once an expert
    assert [[ran[name] for name in layer] for layer in products] == want

    fused = onnx.load(str(tmp_path / "model.ort.onnx"), load_external_data=False)
    assert [node.op_type for node in fused.graph.node].count("MoE") == 2
    read = {name for node in fused.graph.node for name in node.input}
    assert not {name for name in read if re.fullmatch(r"w\.layers\.\d+\.expert_(gate|up)", name)}


def test_inductors_decode_step_reads_the_stacks_by_the_chosen_experts_alone(wide):
    """The decode step torch:inductor compiles, as exported: each expert stack is read by indexing it with
    the chosen experts, and by nothing else."""
    from linnet.backends.torch import aot

    runner = create_runner("torch:inductor", open_model(str(wide)).weights, CacheShape(2, 16))  # compiles nothing yet
    one = torch.zeros((2, 1), dtype=torch.int64)
    with torch.no_grad():
        program = torch.export.export(aot.Step(runner.model), (one, one, torch.arange(2), None,
                                                               aot.state(runner.model)))
    graph = program.graph_module.graph
    stacks = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs
              if spec.target and spec.target.rsplit(".", 1)[-1] in STACKS}
    assert len(stacks) == 6
    for node in graph.nodes:
        if node.name in stacks:
            assert [user.target for user in node.users] == [torch.ops.aten.index.Tensor], stacks[node.name]


@pytest.mark.parametrize("backend", ["torch:eager", "xla:stablehlo", "onnx:cpu"])
def test_the_serving_engine_gives_each_request_its_own_experts(wide, backend):
    """`linnet serve`'s engine on a mixture of experts: requests taking turns in two rows, decoded together
    (each row's token picking 2 of 16 experts), give the tokens each gives alone."""
    from linnet.generation import generate
    from linnet.serve import Engine, Params

    model = open_model(str(wide))
    runner = create_runner(backend, model.weights, CacheShape(2, 48))
    prompts = [PROMPT, [5, 9, 300], PROMPT[3:9], [77]]
    alone = [generate(runner, ids, 6, eos_ids=[]).token_ids for ids in prompts]
    engine = Engine(runner, model.tokenizer, prefill_tokens=8)
    requests = [engine.submit(ids, Params(max_tokens=6, ignore_eos=True)) for ids in prompts]
    engine.start()
    try:
        assert [r.result().token_ids for r in requests] == alone
    finally:
        engine.stop()

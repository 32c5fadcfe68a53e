"""Matrices in llama.cpp's blocks (q8_0, q4_0, q4_1, and the K-quants of a file) on the CPU paths that run them.

Tolerances (absolute, on logits), each against the same step computed another way:
- Against the same blocks' dequantised values in f32 (the NumPy interpreter on the same program and
  weights, or the same file run with ``quantize="none"``): only the summation order differs, so f32's
  budget, 1e-4 x max|logit| (measured ~2e-6 on SmolLM2).
- Against transformers given the values the blocks stand for: the same, 1e-4 x max|logit|.
- Against transformers on the unquantised checkpoint, q8_0 only: the quantisation error itself, a
  weight off by at most max|block| / 254. On the tiny models' random weights the logits moved by up to
  3.7% of max|logit| (measured), the greedy token agreeing at 92% of positions; allowed 5% and 75%.
  (4-bit moved them by 27-58% there: random matrices of two blocks a row are 4 bits' worst case, so
  4-bit is checked against its own values only.)
- Against llama.cpp on the same GGUF file: llama.cpp rounds the activations to 8 bits before each
  quantised product (tests/gguf/test_llamacpp.py), so near-ties can flip: along llama.cpp's own greedy
  path, the same next token at >= 90% of positions (85% with int8 activations of our own, below).

onnx:cpu multiplies blocks with int8 activations (``Program.int8_activations``, as llama.cpp does).
One product matches the interpreter's within 1e-5 (tests/backends/onnx/test_blocks.py), but a whole
model has no elementwise bound: where two computations of x differ in the last bit, a value can round
to the neighbouring int8 code, and later layers amplify it. The interpreter itself, given x moved by
1e-6 (relative) before each rounding, moved its logits by up to 1.3% (q4_0) and 4.1% (q4_1) of
max|logit| on the tiny models and 7% on SmolLM2's q8_0 (measured). So against its own program: 8% of
max|logit| and the same greedy token at >= 75% of positions (measured 3.7% at most); against the
dequantised values in float32, where the rounding of x itself adds: 15% (measured up to 9.1%).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from checkpoints import Case, build_checkpoint

from linnet.backends import CacheShape, create_runner
from linnet.backends.onnx.export import onnx_program
from linnet.backends.reference.interpreter import run_step
from linnet.backends.torch.runner import torch_program
from linnet.backends.torch.step_functions import super_blocks
from linnet.default_model import DEFAULT_MODEL
from linnet.errors import LinnetError
from linnet.gguf.export import export_gguf
from linnet.model import open_model
from linnet.quantize import BLOCK_BYTES, K_QUANTS, dequantized, quantized
from linnet.rope import rope_tables
from linnet.weight_plan import WeightPlan, plan_weights

transformers = pytest.importorskip("transformers")

# Whole 32-blocks: hidden 64, intermediate 128 (the shared tiny cases' 48 and 104 are not).
BLOCKS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
CASES = {
    "llama-untied": Case("llama-untied", "LlamaForCausalLM", dict(BLOCKS, tie_word_embeddings=False)),
    "qwen2-tied": Case("qwen2-tied", "Qwen2ForCausalLM", dict(BLOCKS, tie_word_embeddings=True)),
}
# Layers of two kinds (sliding and full): their matrices are the same weights of each layer
KINDS = Case("gemma2-kinds", "Gemma2ForCausalLM", dict(BLOCKS, sliding_window=6, query_pre_attn_scalar=16,
                                                       layer_types=["sliding_attention", "full_attention"]))
PROMPT = [1, 17, 250, 3, 99, 42, 7, 300, 12, 5, 77, 31]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built = {}

    def get(case: str):
        if case not in built:
            built[case] = build_checkpoint({**CASES, KINDS.id: KINDS}[case], tmp_path_factory.mktemp(case))
        return built[case]

    return get


def reference_step(weights, program, ids: list[int]) -> np.ndarray:
    """The program on its planned weights (blocks included), interpreted in NumPy: logits [T, vocab]."""
    spec = weights.spec
    arrays = plan_weights(weights, WeightPlan(program.weight_dtype, program.fused, program.folded, program.quantized))
    cos, sin = rope_tables(spec, 64)
    cache = [np.zeros((1, spec.num_kv_heads, 64, spec.head_dim), np.float32) for _ in range(spec.num_layers)]
    inputs = {"tokens": np.array([ids]), "positions": np.arange(len(ids))[None], "rows": np.array([0]),
              "select": np.arange(len(ids))[None], "rope_cos": cos, "rope_sin": sin}
    return run_step(program, arrays, inputs, (cache, [c.copy() for c in cache]))[0][0]


# Each backend that runs blocks, and the program it runs (its blocks' arithmetic included).
PROGRAMS = {
    "torch:eager": lambda weights, form: torch_program(weights.spec, quantize=form, weights=weights),
    "onnx:cpu": lambda weights, form: onnx_program(weights.spec, "f32", weights, form),
}


@pytest.mark.parametrize("form", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", sorted(PROGRAMS))
def test_blocks_against_their_dequantised_values(backend, case, form, checkpoint):
    model = open_model(str(checkpoint(case)))
    runner = create_runner(backend, model.weights, CacheShape(1, 64), quantize=form)
    assert runner.describe()["blocks"] == form
    ours = runner.prefill(0, PROMPT, all_logits=True)
    # the Program's definition (the NumPy interpreter) on the same blocks
    program = PROGRAMS[backend](model.weights, form)
    own = reference_step(model.weights, program, PROMPT)
    assert_close(ours, own, program.int8_activations)
    # transformers on the values the blocks stand for (blocks are row-local: quantising q, k and v apart
    # gives the rows of quantising their fused matrix)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(case), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(dequantized(quantized(p.numpy(), form), form)))
        theirs = hf(torch.tensor([PROMPT])).logits[0].numpy()
    budget = 0.15 if program.int8_activations else 1e-4
    assert np.abs(ours - theirs).max() <= budget * np.abs(theirs).max()


def assert_close(ours: np.ndarray, own: np.ndarray, int8_activations: bool) -> None:
    """Logits against the same program interpreted (the module's docstring for the budgets)."""
    if not int8_activations:
        assert np.abs(ours - own).max() <= 1e-4 * np.abs(own).max()
        return
    assert np.abs(ours - own).max() <= 0.08 * np.abs(own).max()
    assert (ours.argmax(-1) == own.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("case", sorted(CASES))
def test_q8_0_stays_near_the_unquantised_model(case, checkpoint):
    model = open_model(str(checkpoint(case)))
    ours = create_runner("torch:eager", model.weights, CacheShape(1, 64), quantize="q8_0").prefill(
        0, PROMPT, all_logits=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(case), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 0.05 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("case", ["llama-untied", KINDS.id])
@pytest.mark.parametrize("backend", sorted(PROGRAMS))
def test_a_q8_0_gguf_file_runs_in_its_own_blocks(backend, case, checkpoint, tmp_path):
    """Its llama q and k rows are stored permuted for llama.cpp's rotary: the blocks are put back too.
    Every layer matrix stays in blocks, in layers of one kind or of several."""
    hf = open_model(str(checkpoint(case)))
    model = open_model(str(export_gguf(hf, tmp_path / "m.gguf", "q8_0")))
    blocks = create_runner(backend, model.weights, CacheShape(1, 64), quantize="gguf")
    floats = create_runner(backend, model.weights, CacheShape(1, 64), quantize="none")
    assert blocks.describe()["blocks"] == "q8_0" and "blocks" not in floats.describe()
    ours, floats = (r.prefill(0, PROMPT, all_logits=True) for r in (blocks, floats))
    program = PROGRAMS[backend](model.weights, "gguf")
    layer_matrices = {name for section, name, _ in program.quantized if section == "layer"}
    assert {"o", "down"} <= layer_matrices and {"qkv", "q"} & layer_matrices
    assert_close(ours, reference_step(model.weights, program, PROMPT), program.int8_activations)
    budget = 0.15 if program.int8_activations else 1e-4  # the module's docstring
    assert np.abs(ours - floats).max() <= budget * np.abs(floats).max()


def q4_k_m_file(case: Case, directory: Path) -> Path:
    """llama.cpp's own Q4_K_M quantisation of ``case``'s tiny checkpoint, whose rows are whole super-blocks of
    256: its matrices in Q4_K, some in Q6_K."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python makes the K-quant file")
    import ctypes

    floats = export_gguf(open_model(str(build_checkpoint(case, directory / "hf"))), directory / "f32.gguf", "f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    out = directory / "q4_k_m.gguf"
    assert llama_cpp.llama_model_quantize(str(floats).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """A tiny Qwen2's Q4_K_M file."""
    return q4_k_m_file(Case("qwen2-k", "Qwen2ForCausalLM", dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=False)), tmp_path_factory.mktemp("k-quants"))


def test_a_k_quant_file_runs_in_its_own_blocks_on_onnx_runtime(k_quant_file):
    """A matrix runs in blocks where every layer stores its parts in one form: Q4_K_M gives one layer's v
    and down projections Q6_K, so the fused q/k/v and the down matrices run dequantised."""
    model = open_model(str(k_quant_file))
    runner = create_runner("onnx:cpu", model.weights, CacheShape(1, 64))
    assert runner.describe()["blocks"] == "q4_k, q6_k"
    program = PROGRAMS["onnx:cpu"](model.weights, "gguf")
    assert set(program.quantized) == {("head", "embed", "q4_k"), ("head", "lm_head", "q6_k"),
                                      ("layer", "gate_up", "q4_k"), ("layer", "o", "q4_k")}
    ours = runner.prefill(0, PROMPT, all_logits=True)
    assert_close(ours, reference_step(model.weights, program, PROMPT), program.int8_activations)  # measured 1.3%
    # torch's blocks are the forms it makes: it runs this file dequantised
    assert "blocks" not in create_runner("torch:eager", model.weights, CacheShape(1, 8), quantize="gguf").describe()


@pytest.mark.llamacpp
def test_a_k_quant_file_agrees_with_llama_cpp(k_quant_file):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    llm = llama_cpp.Llama(str(k_quant_file), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    llm.eval(PROMPT)
    path = list(PROMPT)
    for _ in range(24):
        path.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([path[-1]])
    theirs = np.array(llm.scores[: len(path) - 1])
    runner = create_runner("onnx:cpu", open_model(str(k_quant_file)).weights, CacheShape(1, 64))
    ours = runner.prefill(0, path[:-1], all_logits=True)
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.85  # measured 0.94


@pytest.mark.parametrize("bad", ["q5_k", "q4_k", "int4"])  # q4_k runs from files, is never made
@pytest.mark.parametrize("backend", sorted(PROGRAMS))
def test_a_block_form_the_cpu_path_cannot_run_is_named(backend, bad, checkpoint):
    weights = open_model(str(checkpoint("qwen2-tied"))).weights
    with pytest.raises(LinnetError, match=bad):
        create_runner(backend, weights, CacheShape(1, 16), quantize=bad)


@pytest.mark.parametrize("backend", sorted(PROGRAMS))
def test_a_matrix_of_partial_blocks_is_named(backend, checkpoint_dir):
    weights = open_model(str(checkpoint_dir("qwen2-tied"))).weights  # hidden 48: not whole 32-blocks
    with pytest.raises(LinnetError, match="whole 32-blocks"):
        create_runner(backend, weights, CacheShape(1, 16), quantize="q8_0")


# -- the default model, SmolLM2's Q4_1 file (its embedding and tied head in Q8_0) ----------------------

@pytest.fixture(scope="module")
def smollm2():
    model = open_model(DEFAULT_MODEL)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    return model, prompt


@pytest.mark.parametrize("backend", sorted(PROGRAMS))
def test_the_default_model_runs_in_its_own_blocks(backend, smollm2):
    _, prompt = smollm2
    model = open_model(DEFAULT_MODEL)  # fresh: nothing has read its weights as floats yet
    blocks = create_runner(backend, model.weights, CacheShape(1, 128), quantize="gguf")
    assert blocks.describe()["blocks"] == "q4_1, q8_0"
    assert model.weights._floats is None  # the file was never widened to f32
    # the default: eager would dequantise whole matrices at every step; ONNX Runtime multiplies blocks
    default = create_runner(backend, model.weights, CacheShape(1, 8)).describe()
    assert default.get("blocks") == (None if backend == "torch:eager" else "q4_1, q8_0")
    floats = create_runner(backend, model.weights, CacheShape(1, 128), quantize="none")
    ours, own = (r.prefill(0, prompt, all_logits=True) for r in (blocks, floats))
    if PROGRAMS[backend](model.weights, "gguf").int8_activations:  # no elementwise bound (the docstring)
        assert (ours.argmax(-1) == own.argmax(-1)).mean() >= 0.85  # measured 0.92
    else:
        assert np.abs(ours - own).max() <= 1e-4 * np.abs(own).max()


@pytest.mark.llamacpp
@pytest.mark.parametrize("backend", sorted(PROGRAMS))
def test_the_default_model_in_its_blocks_agrees_with_llama_cpp(backend, smollm2):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    model, prompt = smollm2
    llm = llama_cpp.Llama(str(model.path), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    llm.eval(prompt)
    path = list(prompt)
    for _ in range(24):
        path.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([path[-1]])
    theirs = np.array(llm.scores[: len(path) - 1])
    runner = create_runner(backend, model.weights, CacheShape(1, 128), quantize="gguf")
    ours = runner.prefill(0, path[:-1], all_logits=True)
    # int8 activations round as llama.cpp's do, but flip apart from its (the docstring): measured 0.87
    agreement = 0.85 if PROGRAMS[backend](model.weights, "gguf").int8_activations else 0.9
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= agreement


@pytest.mark.slow
@pytest.mark.parametrize("form", ["q8_0", "q4_1"])
def test_the_compiled_decode_step_in_blocks_matches_eager(form, checkpoint, tmp_path):
    """The two forms of the default model's file, on the tiny models (compiling SmolLM2's 30 layers took 6
    minutes of CI's time, and its blocks run the same kernels): q8_0 as a GGUF file's own blocks,
    inductor's default on the CPU; q4_1 asked for."""
    if form == "q8_0":
        model = open_model(str(export_gguf(open_model(str(checkpoint("llama-untied"))), tmp_path / "m.gguf", "q8_0")))
        asked = None
    else:
        model, asked = open_model(str(checkpoint("qwen2-tied"))), "q4_1"
    compiled = create_runner("torch:inductor", model.weights, CacheShape(1, 64), quantize=asked)
    eager = create_runner("torch:eager", model.weights, CacheShape(1, 64), quantize=asked or "gguf")
    assert compiled.describe()["blocks"] == eager.describe()["blocks"] == form
    steps = []
    for runner in (compiled, eager):
        token = int(runner.prefill(0, PROMPT[:8]).argmax())
        steps.append(runner.decode([token])[0])
    assert np.abs(steps[0] - steps[1]).max() <= 1e-4 * np.abs(steps[1]).max()


def test_the_program_records_each_matrix_in_blocks(checkpoint):
    program = torch_program(open_model(str(checkpoint("qwen2-tied"))).spec, quantize="q4_1")
    text = str(program)
    assert "qkv: q4_1[128, 64]" in text and "embed: q4_1[331, 64]" in text and "norm: f32[64]" in text
    assert "layer: qkv in q4_1 blocks" in text
    assert {op.kind for op in program.layer.ops} >= {"norm_linear"} and not program.folded  # values kept as stored


# Mixtures of experts whose stacks are whole blocks (intermediate 64): softmax then top 2 renormalised
# (Mixtral), a softmax over the top 2 logits with multipliers (Granite), biased experts with a clamped SwiGLU
# beside sinks and a window (gpt-oss).
EXPERTS = dict(BLOCKS, intermediate_size=64, num_local_experts=5, num_experts_per_tok=2)
MOE_CASES = {
    "mixtral-blocks": Case("mixtral-blocks", "MixtralForCausalLM", EXPERTS),
    "granitemoe-blocks": Case("granitemoe-blocks", "GraniteMoeForCausalLM", dict(
        EXPERTS, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=3.0)),
    "gptoss-blocks": Case("gptoss-blocks", "GptOssForCausalLM", dict(  # GGUF: plain rope, the default limit
        EXPERTS, sliding_window=5, rope_parameters=dict(rope_type="default", rope_theta=1e4))),
}
STACKS = {"expert_gate", "expert_up", "expert_down"}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    built = {}

    def get(case: str):
        if case not in built:
            built[case] = build_checkpoint(MOE_CASES[case], tmp_path_factory.mktemp(case))
        return built[case]

    return get


def ort_graph(weights, program):
    """The ort variant's graph of ``program`` (built, not run)."""
    from linnet.backends.onnx.export import planned_arrays
    from linnet.backends.onnx.graph import GraphOptions, build_graph

    shapes = {name: a.shape for name, a in planned_arrays(weights, program).items()}
    return build_graph(program, shapes, 64, GraphOptions("ort", "f32", "gqa"))[0].graph


def assert_runs_as_the_program(runner, weights, program) -> None:
    """The prompt's logits, then three decode steps' (the one-token routing), against the program
    interpreted over the whole sequence, all rows at once under ``assert_close``'s budgets."""
    ids = list(PROMPT)
    ours = [runner.prefill(0, ids, all_logits=True)]
    for token in (5, 300, 42):
        ids.append(token)
        ours.append(runner.decode([token])[:1])
    assert_close(np.concatenate(ours), reference_step(weights, program, ids), program.int8_activations)


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_a_q8_0_gguf_files_experts_run_in_their_blocks_on_onnx_runtime(case, moe_checkpoint, tmp_path):
    """Each sparse layer is one com.microsoft QMoE on the file's own q8_0 codes: no float copy of an
    expert stack is made, and the step is the Program's with its expert products on int8 activations."""
    model = open_model(str(export_gguf(open_model(str(moe_checkpoint(case))), tmp_path / "m.gguf", "q8_0")))
    program = PROGRAMS["onnx:cpu"](model.weights, "gguf")
    assert {(name, form) for section, name, form in program.quantized if name in STACKS} == \
        {(name, "q8_0") for name in STACKS}
    graph = ort_graph(model.weights, program)
    kinds = [node.op_type for node in graph.node]
    assert kinds.count("QMoE") == model.spec.num_layers and "MoE" not in kinds
    floats = [t.name for t in graph.initializer if "expert_" in t.name and t.data_type != onnx.TensorProto.UINT8
              and not t.name.endswith((".scales", "_bias"))]
    assert not floats  # the stacks are codes and scales only

    blocks = create_runner("onnx:cpu", model.weights, CacheShape(1, 64), quantize="gguf")
    dequantised = create_runner("onnx:cpu", model.weights, CacheShape(1, 64), quantize="none")
    assert_runs_as_the_program(blocks, model.weights, program)
    ours, floats_out = (r.prefill(0, PROMPT, all_logits=True) for r in (blocks, dequantised))
    # Against the file's values in f32 the module's 15%, per row at 75% of the rows: a token whose x rounds
    # to other int8 codes may pick another expert, which moves its row wholesale (the interpreter itself
    # moved one row of Granite's case by 23% of max|logit|, the others by at most 4%, measured).
    rows = np.abs(ours - floats_out).max(axis=-1) <= 0.15 * np.abs(floats_out).max()
    assert rows.mean() >= 0.75


@pytest.mark.parametrize("form", ["q8_0", "q4_0"])
@pytest.mark.parametrize("case", ["mixtral-blocks", "gptoss-blocks"])
def test_experts_quantised_at_load_run_in_their_blocks_on_onnx_runtime(case, form, moe_checkpoint):
    """``--quantize q8_0|q4_0`` on an HF checkpoint puts the expert stacks in blocks too (QMoE's 4-bit
    products at accuracy level 4 round x to int8, as the Program says), and never gpt-oss's expert biases
    (vectors, not matrices); q4_1's mins are beyond QMoE, so its stacks stay floats while the other
    matrices go to blocks."""
    model = open_model(str(moe_checkpoint(case)))
    runner = create_runner("onnx:cpu", model.weights, CacheShape(1, 64), quantize=form)
    program = PROGRAMS["onnx:cpu"](model.weights, form)
    assert STACKS <= {name for _, name, _ in program.quantized}
    assert not any(name.endswith("_bias") for _, name, _ in program.quantized)
    assert_runs_as_the_program(runner, model.weights, program)
    q4_1 = PROGRAMS["onnx:cpu"](model.weights, "q4_1")
    assert not STACKS & {name for _, name, _ in q4_1.quantized} and q4_1.quantized


@pytest.mark.parametrize("form", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_experts_quantised_at_load_run_in_their_blocks_on_torch(case, form, moe_checkpoint):
    """``--quantize`` on torch:eager puts the expert stacks in blocks as well, in each form it runs (its
    Blocks dequantise the chosen experts where a product reads them, in f32: the Program's values exactly)."""
    model = open_model(str(moe_checkpoint(case)))
    runner = create_runner("torch:eager", model.weights, CacheShape(1, 64), quantize=form)
    program = PROGRAMS["torch:eager"](model.weights, form)
    assert {(name, f) for _, name, f in program.quantized if name in STACKS} == {(name, form) for name in STACKS}
    assert runner.describe()["blocks"] == form and not program.int8_activations
    assert_runs_as_the_program(runner, model.weights, program)


def test_a_q8_0_gguf_files_experts_run_in_their_blocks_on_torch(moe_checkpoint, tmp_path):
    """The file's own q8_0 stacks, read as the file holds them: no float copy of an expert is made."""
    model = open_model(str(export_gguf(open_model(str(moe_checkpoint("mixtral-blocks"))), tmp_path / "m.gguf", "q8_0")))
    runner = create_runner("torch:eager", model.weights, CacheShape(1, 64), quantize="gguf")
    program = PROGRAMS["torch:eager"](model.weights, "gguf")
    stacks = {(name, form) for _, name, form in program.quantized if name in STACKS}
    assert stacks == {(name, "q8_0") for name in STACKS}
    floats = [name for name, t in runner.model.named_buffers()
              if "expert_" in name and t.is_floating_point() and not name.endswith((".scales", "_bias"))]
    assert not floats  # the stacks are codes and scales only
    assert_runs_as_the_program(runner, model.weights, program)


@pytest.fixture(scope="module")
def k_quant_moe_file(tmp_path_factory):
    """A tiny Mixtral's Q4_K_M file: its experts in K-quant forms."""
    return q4_k_m_file(Case("mixtral-k", "MixtralForCausalLM", dict(
        EXPERTS, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
        tmp_path_factory.mktemp("k-quant-experts"))


@pytest.mark.parametrize("form", K_QUANTS)
def test_torch_dequantises_k_quant_super_blocks_as_gguf_does(form):
    """Any codes, scales and mins (random bytes, the f16 fields finite): gguf.quants' values, bit for bit."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 4, BLOCK_BYTES[form]), dtype=np.uint8)  # [rows, super-blocks, bytes]
    for at in (0, 2) if form == "q4_k" else (208,):  # d (and dmin)
        raw[..., at:at + 2] = rng.uniform(-0.1, 0.1, size=(3, 4, 1)).astype(np.float16).view(np.uint8)
    ours = super_blocks(form, torch.from_numpy(raw)).flatten(-2).numpy()
    np.testing.assert_array_equal(ours, dequantized(raw.reshape(3, -1), form))


def test_a_k_quant_files_experts_run_in_their_super_blocks_on_torch(k_quant_moe_file):
    """torch:eager keeps a file's K-quant expert stacks as the file holds them and dequantises the chosen
    experts' super-blocks alone for their tokens: the Program's values, f32's budget. Here the gate and up
    stacks (Q4_K in both layers); Q4_K_M gives one layer's down experts Q6_K, and a stack whose layers mix
    forms runs dequantised, as do the file's other K-quant matrices on torch."""
    model = open_model(str(k_quant_moe_file))
    stored = {form for name, (form, _) in model.weights.blocks.items() if "expert_" in name}
    assert stored == {"q4_k", "q6_k"}
    runner = create_runner("torch:eager", model.weights, CacheShape(1, 64), quantize="gguf")
    program = PROGRAMS["torch:eager"](model.weights, "gguf")
    stacks = {name: form for _, name, form in program.quantized if name in STACKS}
    assert stacks == {"expert_gate": "q4_k", "expert_up": "q4_k"}
    floats = [name for name, t in runner.model.named_buffers()
              if name.rsplit(".", 1)[-1] in stacks and t.is_floating_point()]
    assert not floats  # super-blocks only: no float copy of a stack
    assert_runs_as_the_program(runner, model.weights, program)


def test_compiled_torch_widens_the_expert_stacks_at_load(moe_checkpoint):
    """inductor's decode loop over gathered experts' blocks is not vectorised (docs/QUANTIZE.md): its
    stacks are floats, while the model's other matrices stay in blocks."""
    model = open_model(str(moe_checkpoint("mixtral-blocks")))
    runner = create_runner("torch:inductor", model.weights, CacheShape(1, 64), quantize="q4_1")  # compiles nothing yet
    stacks = {name: t for name, t in runner.model.named_buffers() if name.rsplit(".", 1)[-1] in STACKS}
    assert stacks and all(t.dtype == torch.float32 for t in stacks.values())
    assert runner.describe()["blocks"] == "q4_1"

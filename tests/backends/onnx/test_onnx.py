"""The ONNX backend's files and loads: `linnet compile --target onnx` writes graphs that onnx's full check
accepts and a plain onnxruntime.InferenceSession runs to the NumPy reference's logits; a provider
missing a kernel is named at load; GPU providers report themselves unavailable here; past 2 GB works.
(Parity with transformers in every dtype is the conformance suite's, which runs onnx:cpu on two-row
caches; the one-row caches' GroupQueryAttention graph is checked against transformers here.)"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from checkpoints import CASE_IDS, FAMILY_CASES, MOE_CASES
from onnx import TensorProto, helper

from linnet.backends import CacheShape, Decode, Prefill, create_runner
from linnet.backends.onnx import runner as onnx_runner
from linnet.backends.onnx.export import onnx_program, planned_arrays
from linnet.backends.onnx.graph import GraphOptions, build_graph
from linnet.backends.registry import get_backend
from linnet.cli import main
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.weights import Weights

CASE = "qwen3-gqa3"  # q/k norm, GQA 3, head_dim 32 != hidden / heads


def step_feeds(spec, tokens: list[int], rows: int = 2, positions: int = 16, dtype=np.float32) -> dict:
    feeds = {"tokens": np.array([tokens]), "positions": np.arange(len(tokens))[None], "rows": np.array([1]),
             "select": np.arange(len(tokens))[None]}
    cache = np.zeros((rows, spec.num_kv_heads, positions, spec.head_dim), dtype)
    for i in range(spec.num_layers):
        feeds[f"cache_k.{i}"], feeds[f"cache_v.{i}"] = cache, cache
    return feeds


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_compiled_files_pass_the_full_check_and_run_in_a_plain_session(checkpoint_dir, tmp_path, capsys, dtype):
    out = tmp_path / "onnx"
    assert main(["compile", str(checkpoint_dir(CASE)), "--target", "onnx", "-o", str(out), "--dtype", dtype]) == 0
    assert "model.onnx" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.ort.onnx", "weights.bin"]
    assert (out / "model.onnx").stat().st_size < 100_000  # the weights are external data
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)  # reads the external data too
    if dtype == "bf16":
        return  # the CPU provider has no bfloat16 products (see test_a_missing_kernel_is_named_at_load)

    model = open_model(str(checkpoint_dir(CASE)))
    tokens = [5, 17, 101, 42, 250, 7]
    want = create_runner("reference:numpy", model.weights, CacheShape(2, 15)).prefill(1, tokens, all_logits=True)
    tolerance = 1e-4 if dtype == "f32" else 0.01 * np.abs(want).max()
    for graph in ("model.onnx", "model.ort.onnx"):
        session = ort.InferenceSession(str(out / graph), providers=["CPUExecutionProvider"])
        feeds = step_feeds(model.spec, tokens, dtype=np.dtype(dtype.replace("f", "float")))
        logits, ids, *caches = session.run(None, feeds)
        assert logits.shape == (1, len(tokens), model.spec.vocab_size) and logits.dtype == np.float32
        assert np.abs(logits[0] - want).max() <= tolerance, graph
        assert (ids == logits.argmax(-1)).all()
        assert np.abs(caches[0][1, :, :len(tokens)]).max() > 0 and not caches[0][0].any()  # row 1 written, row 0 not


@pytest.mark.parametrize("case", [c.id for c in FAMILY_CASES + MOE_CASES])
def test_every_familys_plain_graph_passes_the_full_check_and_gives_the_references_logits(checkpoint_dir, tmp_path,
                                                                                      case):
    """The plain graph (standard operators only: layer kinds, windows, softcaps, LayerNorms, GELUs, partial
    rotary, attention sinks, the experts' Loop) in a plain session; the ort graph is the conformance suite's."""
    out = tmp_path / "onnx"
    assert main(["compile", str(checkpoint_dir(case)), "--target", "onnx", "-o", str(out)]) == 0
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    model = open_model(str(checkpoint_dir(case)))
    tokens = [5, 17, 101, 42, 250, 7, 9, 33, 61]  # past the windows (5, 6)
    want = create_runner("reference:numpy", model.weights, CacheShape(2, 15)).prefill(1, tokens, all_logits=True)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], step_feeds(model.spec, tokens))[0]
    assert np.abs(logits[0] - want).max() <= 1e-4


def test_an_attention_attr_the_emitter_does_not_know_is_an_error_naming_it(checkpoint_dir):
    weights = open_model(str(checkpoint_dir(CASE))).weights
    program = onnx_program(weights.spec, "f32")
    shapes = {name: array.shape for name, array in planned_arrays(weights, program).items()}
    layer = program.layer
    ops = tuple(replace(op, attrs={**op.attrs, "alibi": 4}) if op.kind == "attention" else op for op in layer.ops)
    program = replace(program, kinds={kind: replace(layer, ops=ops) for kind in program.kinds})
    with pytest.raises(LinnetError, match="attention's alibi"):
        build_graph(program, shapes, 16, GraphOptions("plain"))


@pytest.mark.parametrize("window", [1, 3])
def test_group_query_attentions_local_window_size_counts_the_query(window):
    """ONNX Runtime 1.32's CPU kernel sees ``local_window_size`` keys, the query's own included: the Program's
    window as it is (older sources kept one more). With equal scores, each query's output is the mean of
    the values it sees, here their positions."""
    t, d = 8, 8
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past", "past", "seqlens", "total"],
                            ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=1, kv_num_heads=1,
                            local_window_size=window)
    info = helper.make_tensor_value_info
    inputs = [info(n, TensorProto.FLOAT, [1, t, d]) for n in "qkv"] + [
        info("past", TensorProto.FLOAT, [1, 1, t, d]), info("seqlens", TensorProto.INT32, [1]),
        info("total", TensorProto.INT32, [])]
    graph = helper.make_graph([node], "g", inputs, [info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    zeros, positions = np.zeros((1, t, d), np.float32), np.arange(t, dtype=np.float32)
    out = session.run(None, {"q": zeros, "k": zeros, "v": np.broadcast_to(positions[None, :, None], (1, t, d)).copy(),
                             "past": np.zeros((1, 1, t, d), np.float32), "seqlens": np.array([t - 1], np.int32),
                             "total": np.array(t, np.int32)})[0]
    seen = [positions[max(0, p - window + 1):p + 1].mean() for p in range(t)]
    assert np.allclose(out[0, :, 0], seen)


def test_a_missing_kernel_is_named_at_load(checkpoint_dir, monkeypatch):
    # A true bfloat16 graph on the CPU provider, which has no bfloat16 Gemm (the backend's own CPU graph
    # holds bfloat16 values in float32 for this reason): the load names the op and what runs instead.
    monkeypatch.setattr(onnx_runner, "graph_options", lambda *args: GraphOptions("plain"))
    weights = open_model(str(checkpoint_dir(CASE))).weights
    with pytest.raises(LinnetError, match=r"CPUExecutionProvider has no bf16 kernel for \w+ .*--dtype f32 or f16"):
        create_runner("onnx:cpu", weights, CacheShape(1, 16), dtype="bf16")


@pytest.mark.parametrize("backend", ["onnx:cuda", "onnx:tensorrt"])
def test_gpu_providers_say_why_they_cannot_run(backend):
    if get_backend(backend).unavailable() is None:
        pytest.skip(f"{backend} runs here: the GPU check script covers it")
    assert "ExecutionProvider" in get_backend(backend).unavailable()
    with pytest.raises(LinnetError, match=f"{backend} cannot run here: this onnxruntime has no"):
        create_runner(backend, None, CacheShape(1, 16))


@pytest.mark.parametrize("set_by_user", [None, "0"])
def test_cpu_sessions_are_built_without_the_gqa_flash_path(checkpoint_dir, monkeypatch, set_by_user):
    """Slower on the CPU where it was measured; a value the user set wins, and the environment is left as it was."""
    name = "ORT_GQA_DISABLE_FLASH_ATTENTION"
    if set_by_user is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, set_by_user)
    seen, session = [], ort.InferenceSession
    monkeypatch.setattr(onnx_runner.ort, "InferenceSession", lambda *a, **k: seen.append(os.environ.get(name)) or
                        session(*a, **k))
    create_runner("onnx:cpu", open_model(str(checkpoint_dir(CASE))).weights, CacheShape(1, 16))
    assert seen == [set_by_user or "1"]
    assert os.environ.get(name) == set_by_user


def test_a_greedy_step_brings_back_ids_from_the_graph(checkpoint_dir):
    runner = create_runner("onnx:cpu", open_model(str(checkpoint_dir(CASE))).weights, CacheShape(2, 32))
    out = runner._forward(np.array([[3, 9, 27]]), np.array([[0, 1, 2]]), np.array([0]), None)
    assert (out.ids == out.host_logits().argmax(-1)).all()  # the graph's ArgMax, not the host's


# q/k/v packed into the kernel; q/k norm before it; softcap and window (local_window_size) on one layer kind
# of two; partial rotary (rotated apart from the kernel)
@pytest.mark.parametrize("case", ["llama-gqa3", "qwen3-gqa3", "gemma2-softcap-window6", "phi3-partial"])
def test_group_query_attention_over_windows_of_rows_gives_the_general_graphs_logits(checkpoint_dir, case,
                                                                                    monkeypatch):
    weights = open_model(str(checkpoint_dir(case))).weights
    one, two = (create_runner("onnx:cpu", weights, CacheShape(rows, 32)) for rows in (1, 2))
    assert one.describe()["attention"] == two.describe()["attention"] == "gqa"
    general = onnx_runner.graph_options
    monkeypatch.setattr(onnx_runner, "graph_options", lambda *a: replace(general(*a), attention="gather", ragged=False))
    gather = create_runner("onnx:cpu", weights, CacheShape(2, 32))
    assert gather.describe()["attention"] == "gather"
    tokens = [5, 17, 101, 42, 250, 7, 9, 33, 61]

    def run(runner, idle: list[int]) -> list[np.ndarray]:
        out = [runner.prefill(0, tokens[:5], all_logits=True), runner.prefill(0, tokens[5:], start=5)]
        out += [runner.decode([token, *idle], [True, *[False] * len(idle)])[0] for token in (3, 4)]
        # not contiguous (and out of order): a token at a time on the gqa graph
        step = runner._forward(np.array([[8, 9, 10]]), np.array([[14, 11, 13]]), np.array([0]), np.array([[2, 0]]))
        return [*out, step.host_logits(), step.ids]

    want = run(gather, [0])
    for runner, idle in ((one, []), (two, [0])):
        for got, expected in zip(run(runner, idle), want):
            assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-4


def test_a_window_of_rows_leaves_the_rows_outside_it_alone(checkpoint_dir):
    """Row 2 decodes alone: the window is that row; rows 0, 1 and 3 keep their caches."""
    runner = create_runner("onnx:cpu", open_model(str(checkpoint_dir(CASE))).weights, CacheShape(4, 32))
    for row in range(4):
        runner.prefill(row, [5 + row, 17, 101])
    before = [c.copy() for c in runner.caches]
    runner.decode([0, 0, 42, 0], [False, False, True, False])
    for old, new in zip(before, runner.caches):
        assert np.array_equal(old[[0, 1, 3], :, :runner.scratch_position], new[[0, 1, 3], :, :runner.scratch_position])
        assert not np.array_equal(old[2], new[2])  # position 3 of row 2 was written


def test_several_rows_chunks_after_their_pasts_go_in_one_call_of_their_own_tokens(checkpoint_dir, monkeypatch):
    """Speculation's checks (``Runner.verify``) of rows 0, 1, 2 and 4, of different lengths: one call over
    the window of rows 0-4 whose products run on the chunks' own 12 tokens (GroupQueryAttention alone pads its
    rows to the longest); every position's logits are the reference's, and row 3, in the window without a
    chunk, keeps what it holds (only positions past its length are written)."""
    weights = open_model(str(checkpoint_dir(CASE))).weights
    runner = create_runner("onnx:cpu", weights, CacheShape(5, 32))
    reference = create_runner("reference:numpy", weights, CacheShape(5, 32))
    for each in (runner, reference):
        for row in range(5):
            each.prefill(row, [5 + row, 17, 101, 7][:2 + row % 3])
    held = runner.lengths[3]
    before = [c[3, :, :held].copy() for c in runner.caches]
    calls = []
    run = runner._run
    monkeypatch.setattr(runner, "_run", lambda tokens, *rest: calls.append(tokens.shape) or run(tokens, *rest))
    chunks = {4: [9, 8, 7], 0: [3, 4], 2: [11, 12, 13, 14], 1: [6, 6, 6]}
    got, want = runner.verify(chunks), reference.verify(chunks)
    assert runner.ragged_checks and calls == [(1, 12)]
    for row, chunk in chunks.items():
        assert got[row].shape == (len(chunk), weights.spec.vocab_size)
        assert np.abs(got[row] - want[row]).max() <= 1e-4
    assert all(np.array_equal(old, new[3, :, :held]) for old, new in zip(before, runner.caches))
    only_3 = [row == 3 for row in range(5)]  # and decodes on as the reference does
    assert np.abs(runner.decode([5] * 5, only_3)[3] - reference.decode([5] * 5, only_3)[3]).max() <= 1e-4


@pytest.mark.parametrize("case", ["llama-gqa3", CASE])  # the rotations in the kernel; q/k norms before them
def test_a_ragged_check_gives_the_padded_checks_logits_and_caches(checkpoint_dir, case):
    """A check whose rows' chunks differ in length computes their own tokens only: the logits and the caches'
    written positions are those of the same check padded to the longest chunk (every row's products)."""
    weights = open_model(str(checkpoint_dir(case))).weights
    ragged, padded = (create_runner("onnx:cpu", weights, CacheShape(3, 32)) for _ in range(2))
    padded.ragged_checks = False
    for runner in (ragged, padded):
        for row in range(3):
            runner.prefill(row, [5 + row, 17, 101, 7, 3][:3 + row])
    chunks = {0: [9, 8, 7, 6, 5], 1: [4], 2: [11, 12]}
    got, want = ragged.verify(chunks), padded.verify(chunks)
    for row, chunk in chunks.items():
        assert np.abs(got[row] - want[row]).max() <= 1e-4
        length = ragged.lengths[row]
        for mine, theirs in zip(ragged.caches, padded.caches):
            assert np.abs(mine[row, :, :length + len(chunk)] - theirs[row, :, :length + len(chunk)]).max() <= 1e-5


def test_rings_keep_checks_padded(checkpoint_dir):
    """A sliding layer's ring reads the step's rows, not GroupQueryAttention's: its checks stay padded."""
    weights = open_model(str(checkpoint_dir("mistral-window5"))).weights
    ringed = create_runner("onnx:cpu", weights, CacheShape(2, 32, chunk=4))  # rings of 5 + 4 - 1 slots
    assert ringed.rings and not ringed.ragged_checks
    whole = create_runner("onnx:cpu", weights, CacheShape(2, 32))  # a window the whole cache holds: no ring
    assert not whole.rings and whole.ragged_checks


def test_first_prompts_of_rows_apart_share_one_scratch_and_give_what_each_gives_alone(checkpoint_dir):
    """Groups of rows that are not consecutive are read on one scratch kept between calls: a wider group
    grows it, a narrower one reads a part of it, and each row's cache ends up as its prompt read alone."""
    weights = open_model(str(checkpoint_dir(CASE))).weights
    together, alone = (create_runner("onnx:cpu", weights, CacheShape(8, 32)) for _ in range(2))
    rng = np.random.RandomState(5)
    groups = [{0: 5, 2: 3}, {1: 11, 5: 9, 7: 4}, {3: 2, 6: 6}]  # row -> prompt length; the 2nd grows it
    prompts = {row: rng.randint(3, 331, n).tolist() for group in groups for row, n in group.items()}
    sizes = []
    for group in groups:
        together.step(prefill=[Prefill(row, prompts[row]) for row in group])
        sizes.append(together._scratch[0].size)
    assert sizes[0] < sizes[1] == sizes[2]
    tokens = {row: alone.step(prefill=[Prefill(row, ids)])[row].token for row, ids in prompts.items()}
    for _ in range(3):
        got = together.step(decode=[Decode(row, token) for row, token in tokens.items()], logits=True)
        want = alone.step(decode=[Decode(row, token) for row, token in tokens.items()], logits=True)
        for row in tokens:
            assert got[row].token == want[row].token
            assert np.abs(got[row].logits - want[row].logits).max() <= 1e-4
        tokens = {row: want[row].token for row in tokens}


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", CASE_IDS)
def test_the_one_row_graph_matches_transformers(checkpoint_dir, case, dtype):
    # The conformance suite runs two-row caches (the gather graph); this is its check of the gqa graph,
    # where one applies (head sizes in multiples of 8), at the suite's tolerances: a prompt in two chunks,
    # then decode steps, against transformers' logits at every position.
    import torch
    import transformers

    from linnet.dtypes import DTYPES

    weights = open_model(str(checkpoint_dir(case))).weights
    runner = create_runner("onnx:cpu", weights, CacheShape(1, 32), dtype=dtype)
    ids = np.random.RandomState(2).randint(3, weights.spec.vocab_size, size=20).tolist()
    torch_dtype = getattr(torch, DTYPES[dtype].hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir(case), dtype=torch_dtype)
    with torch.no_grad():
        want = model.eval()(torch.tensor([ids])).logits[0].float().numpy()
    got = [*runner.prefill(0, ids[:7], all_logits=True), *runner.prefill(0, ids[7:16], start=7, all_logits=True)]
    got += [runner.decode([token])[0] for token in ids[16:]]
    tolerance = 1e-4 if dtype == "f32" else {"f16": 0.01, "bf16": 0.05}[dtype] * np.abs(want).max()
    assert np.abs(np.stack(got) - want).max() <= tolerance
    assert runner.describe()["attention"] == ("gqa" if weights.spec.head_dim % 8 == 0 else "gather")


@pytest.mark.slow
def test_weights_past_2_gb_export_and_load(tmp_path):
    from linnet.spec import spec_from_hf_config

    spec = spec_from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=10, num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False))
    from linnet.names import expected_shapes

    rng = np.random.default_rng(0)
    arrays = {name: (rng.standard_normal(shape, dtype=np.float32) * 0.02 if len(shape) == 2 else
                     np.ones(shape, np.float32)) for name, shape in expected_shapes(spec).items()}
    assert sum(a.nbytes for a in arrays.values()) > 2**31
    runner = create_runner("onnx:cpu", Weights(spec, arrays), CacheShape(1, 16))
    tokens = [1, 2, 3]
    got = runner.prefill(0, tokens)
    want = create_runner("reference:numpy", Weights(spec, arrays), CacheShape(1, 16)).prefill(0, tokens)
    assert np.abs(got - want).max() <= 1e-4


def test_a_decode_step_on_the_cpu_runs_its_busy_rows_only(checkpoint_dir, monkeypatch):
    """ONNX Runtime compiles nothing per shape: 5 busy rows of 16 decode as 5, not padded to 16, with the
    logits of the rows decoded each alone; the warm-up runs the largest step only."""
    weights = open_model(str(checkpoint_dir(CASE))).weights
    runner, alone = (create_runner("onnx:cpu", weights, CacheShape(16, 32)) for _ in range(2))
    assert runner.decode_sizes() == tuple(range(1, 17)) and runner.warmed_decode_sizes() == (16,)
    for each in (runner, alone):
        for row in range(5):
            each.prefill(row, [5 + row, 17, 101])
    calls = []
    run = runner._run
    monkeypatch.setattr(runner, "_run", lambda tokens, *rest: calls.append(tokens.shape) or run(tokens, *rest))
    got = runner.decode([7] * 16, [row < 5 for row in range(16)])
    assert calls == [(5, 1)]
    for row in range(5):
        want = alone.decode([7] * 16, [r == row for r in range(16)])[row]
        assert np.abs(got[row] - want).max() <= 1e-4

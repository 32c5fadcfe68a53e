"""llama.cpp's blocks as ONNX Runtime's n-bit operators take them (``linnet.backends.onnx.blocks``).

One product at a time, so that nothing amplifies a rounding: MatMulNBits on the converted blocks
against the Program's definition of a product with int8 activations (``linnet.quantize.int8_rounded``
times the blocks' values; a q4_1 min times the block's sum of x as it is), within 1e-5 x max|y|, only
the summation order differing; GatherBlockQuantized gives the blocks' values exactly. (Whole models
are checked in tests/backends/test_quantized.py, where int8 rounding flips allow no elementwise bound.)
"""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from linnet.backends.onnx.blocks import BITS, onnx_parts  # noqa: E402
from linnet.quantize import BLOCK, block_mins, dequantized, int8_rounded, quantized  # noqa: E402

N, K = 80, 192


def session(node: onnx.NodeProto, inputs: list, parts: dict[str, np.ndarray]) -> ort.InferenceSession:
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(a, name) for name, a in parts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(params=["q8_0", "q4_0", "q4_1"])
def blocks(request):
    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    return request.param, quantized(w, request.param)


@pytest.mark.parametrize("rows", [1, 7])
def test_a_product_with_blocks_is_the_programs_definition(blocks, rows):
    form, b = blocks
    parts = onnx_parts(b, form)
    zero_points = ["zero_points"] if "zero_points" in parts else []
    node = helper.make_node("MatMulNBits", ["x", "codes", "scales", *zero_points], ["y"], domain="com.microsoft",
                            K=K, N=N, bits=BITS[form], block_size=BLOCK, accuracy_level=4)
    used = {p: parts[p] for p in ("codes", "scales", *zero_points)}
    x = (np.random.default_rng(1).standard_normal((rows, K)) * 3).astype(np.float32)
    y = session(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, K])], used).run(None, {"x": x})[0]
    w = dequantized(b, form)
    if form == "q4_1":  # the graph adds the mins' part apart (graph._block_matmul)
        mins = block_mins(b).astype(np.float32)
        y = y + x.reshape(rows, -1, BLOCK).sum(-1) @ mins.T
        expected = int8_rounded(x) @ (w - np.repeat(mins, BLOCK, axis=1)).T + x.reshape(rows, -1, BLOCK).sum(-1) @ mins.T
    else:
        expected = int8_rounded(x) @ w.T
    assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()
    assert np.abs(y - x @ w.T).max() > 1e-5 * np.abs(expected).max()  # x was rounded: not the float product


def test_gathered_rows_are_the_blocks_values(blocks):
    form, b = blocks
    parts = onnx_parts(b, form)
    used = {"codes": parts["codes"], "scales": parts["scales"][..., None]}
    if "zero_points" in parts:
        used["zero_points"] = np.zeros((N, K // BLOCK, 1), np.uint8)
    node = helper.make_node("GatherBlockQuantized", ["codes", "ids", "scales", *used.keys() - {"codes", "scales"}],
                            ["y"], domain="com.microsoft", bits=BITS[form], block_size=BLOCK, gather_axis=0,
                            quantize_axis=2)
    ids = np.array([[3, 0, N - 1]], np.int64)
    y = session(node, [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])], used).run(None, {"ids": ids})[0]
    w = dequantized(b, form)
    if form == "q4_1":
        w = w - np.repeat(block_mins(b).astype(np.float32), BLOCK, axis=1)  # the mins are added apart
    assert np.array_equal(y.reshape(3, K), w[ids[0]])

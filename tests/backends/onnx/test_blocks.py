"""llama.cpp's blocks as ONNX Runtime's n-bit operators take them (``linnet.backends.onnx.blocks``).

One product at a time, so that nothing amplifies a rounding: MatMulNBits on the converted blocks
against the Program's definition of a product with int8 activations (``linnet.quantize.int8_rounded``
per block of the form's scales, times the blocks' values; a min times the block's sum of x as it is),
within 1e-5 x max|y|, only the summation order differing; GatherBlockQuantized gives the blocks' values
exactly. (Whole models are checked in tests/backends/test_quantized.py, where int8 rounding flips
allow no elementwise bound.) K-quant blocks are random bytes under a small f16 super-scale: every code
and 6-bit scale occurs, and ``affine`` is checked against gguf's own dequantisation.
"""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from linnet.backends.onnx.blocks import bits, block_size, onnx_parts  # noqa: E402
from linnet.quantize import BLOCK_BYTES, ELEMENTS, FORMS, MADE, affine, dequantized, int8_rounded, quantized  # noqa: E402

N, K = 80, 512
SCALE_AT = {"q4_k": (0, 2), "q6_k": (208,)}  # the f16 super-scales' byte offsets in a block


def session(nodes: list[onnx.NodeProto], inputs: list, parts: dict[str, np.ndarray]) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(a, name) for name, a in parts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(params=sorted(FORMS))
def blocks(request):
    form, rng = request.param, np.random.default_rng(0)
    if form in MADE:
        return form, quantized(rng.standard_normal((N, K)).astype(np.float32), form)
    raw = rng.integers(0, 256, (N, K // ELEMENTS[form], BLOCK_BYTES[form]), dtype=np.uint8)
    for at in SCALE_AT[form]:
        raw[:, :, at:at + 2] = np.array([0.003], np.float16).view(np.uint8)
    return form, raw.reshape(N, -1)


def test_affine_codes_are_the_blocks_values(blocks):
    form, b = blocks
    a = affine(b, form)
    values = np.repeat(a.scales, a.block, axis=1) * (a.codes.astype(np.float32) - a.zero)
    if a.mins is not None:
        values += np.repeat(a.mins, a.block, axis=1)
    assert a.codes.max() < 1 << a.bits and np.array_equal(values, dequantized(b, form))


@pytest.mark.parametrize("rows", [1, 7])
def test_a_product_with_blocks_is_the_programs_definition(blocks, rows):
    form, b = blocks
    parts = onnx_parts(b, form)
    zero_points = ["zero_points"] if "zero_points" in parts else []
    node = helper.make_node("MatMulNBits", ["x", "codes", "scales", *zero_points], ["y"], domain="com.microsoft",
                            K=K, N=N, bits=bits(form), block_size=block_size(form), accuracy_level=4)
    used = {p: parts[p] for p in ("codes", "scales", *zero_points)}
    x = (np.random.default_rng(1).standard_normal((rows, K)) * 3).astype(np.float32)
    y = session([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, K])], used).run(None, {"x": x})[0]
    a, w = affine(b, form), dequantized(b, form)
    expected = int8_rounded(x, a.block) @ w.T
    if a.mins is not None:  # the graph adds the mins' part apart (graph._block_matmul), from x as it is
        sums = x.reshape(rows, -1, a.block).sum(-1)
        y = y + sums @ a.mins.T
        expected = int8_rounded(x, a.block) @ (w - np.repeat(a.mins, a.block, axis=1)).T + sums @ a.mins.T
    bound = 1e-5 * np.abs(expected).max()
    if np.abs(y - x @ w.T).max() <= bound:  # MLAS has int8 kernels per CPU and form; where it lacks one
        pytest.skip(f"ONNX Runtime multiplies {form} in floats on this CPU (no int8 kernel): the values "
                    "are the blocks' own, not the int8 definition's")
    assert np.abs(y - expected).max() <= bound


def test_gathered_rows_are_the_blocks_values(blocks):
    form, b = blocks
    parts = onnx_parts(b, form)
    a = affine(b, form)
    used = {"codes": parts["codes"], "scales": parts["scales"][..., None]}
    if "zero_points" in parts:
        used["zero_points"] = np.full((N, K // a.block, 1), a.zero, np.uint8)
    node = helper.make_node("GatherBlockQuantized", ["codes", "ids", "scales", *used.keys() - {"codes", "scales"}],
                            ["y"], domain="com.microsoft", bits=bits(form), block_size=block_size(form),
                            gather_axis=0, quantize_axis=2)
    ids = np.array([[3, 0, N - 1]], np.int64)
    ids_info = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])
    y = session([node], [ids_info], used).run(None, {"ids": ids})[0]
    w = dequantized(b, form)
    if a.mins is not None:
        w = w - np.repeat(a.mins, a.block, axis=1)  # the mins are added apart
    assert np.array_equal(y.reshape(3, K), w[ids[0]])

"""The ONNX Runtime backend: the Program emitted as an ONNX graph, run on the CPU, CUDA or TensorRT provider."""
from linnet.backends.registry import BackendPackage

PACKAGE = BackendPackage(
    name="onnx",
    modes=(("cpu", "Linnet, ONNX Runtime CPU"), ("cuda", "Linnet, ONNX Runtime CUDA"),
           ("tensorrt", "Linnet, ONNX Runtime TensorRT")),
    dtypes=("f32", "f16", "bf16"),
    group="ONNX Runtime and TensorRT",
    runner="linnet.backends.onnx.runner:OnnxRunner",
    check="linnet.backends.onnx.setup:unavailable",
    compile_targets=(("onnx", "linnet.backends.onnx.export:write"),),
    threads="linnet.backends.onnx.setup:set_threads",
    prepare="linnet.backends.onnx.setup:prepare",
    options=("quantize",),
    # the CPU provider's MoE and GroupQueryAttention sinks are checked; the GPU providers' are not yet
    not_yet=(("cuda", "moe"), ("cuda", "sinks"), ("tensorrt", "moe"), ("tensorrt", "sinks")),
)

"""The PyTorch backend: generated standalone source, run eager, under inductor, or with CUDA graphs."""
from linnet.backends.registry import BackendPackage

PACKAGE = BackendPackage(
    name="torch",
    modes=(("eager", "Linnet, generated PyTorch"), ("inductor", "Linnet, inductor"),
           ("cudagraphs", "Linnet, CUDA graphs")),
    dtypes=("f32", "f16", "bf16"),
    group="PyTorch",
    runner="linnet.backends.torch.runner:TorchRunner",
    check="linnet.backends.torch.setup:unavailable",
    compile_targets=(("torch", "linnet.backends.torch.artifact:write"),),
    threads="linnet.backends.torch.setup:set_threads",
    prepare="linnet.backends.torch.setup:prepare",
    options=("quantize",),
    # a compiled decode step gathers each token's experts (prompts run eager); not yet checked under CUDA graphs
    not_yet=(("cudagraphs", "moe"),),
)

"""The XLA backends: generated JAX source under ``jax.jit``, or Linnet's own StableHLO run by PJRT."""
from linnet.backends.registry import BackendPackage

PACKAGE = BackendPackage(
    name="xla",
    modes=(("jax", "Linnet, XLA (generated JAX)"), ("stablehlo", "Linnet, XLA (StableHLO)")),
    dtypes=("f32", "f16", "bf16"),
    group="JAX",
    runner="linnet.backends.xla.runner:create",
    check="linnet.backends.xla.setup:unavailable",
    compile_target="linnet.backends.xla.artifact:write",
    prepare="linnet.backends.xla.setup:prepare",
    options=("devices",),
)

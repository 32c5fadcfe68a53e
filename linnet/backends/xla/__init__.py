"""The XLA backends: generated JAX source under ``jax.jit``, or Linnet's own StableHLO run by PJRT."""
from linnet.backends.registry import BackendPackage

PACKAGE = BackendPackage(
    name="xla",
    modes=(("jax", "Linnet, XLA (generated JAX)"), ("stablehlo", "Linnet, XLA (StableHLO)")),
    dtypes=("f32", "f16", "bf16"),
    group="JAX",
    runner="linnet.backends.xla.modes:create",
    check="linnet.backends.xla.setup:unavailable",
    compile_targets=(("jax", "linnet.backends.xla.artifact:write_jax"),
                     ("stablehlo", "linnet.backends.xla.artifact:write_stablehlo")),
    threads="linnet.backends.xla.setup:set_threads",
    prepare="linnet.backends.xla.setup:prepare",
    options=("devices", "num_processes", "process_id", "coordinator", "coordinator_timeout"),
)

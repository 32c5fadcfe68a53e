"""The op table: every emitter covers every op (natively or through decompositions), and a
decomposition computes what its composite does."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from checkpoints import FAMILY_CASES

from linnet.backends.reference.interpreter import OPS as REFERENCE_OPS
from linnet.backends.reference.interpreter import run_step
from linnet.backends.registry import get_backend
from linnet.names import expected_shapes
from linnet.program import build_program, lower
from linnet.program.ops import OPS, uncovered
from linnet.rope import rope_tables

# Each emitter's module, the backend it emits for, and the ops it lowers natively; a module that cannot be
# imported here (its runtime missing) is skipped.
EMITTERS = {"linnet.backends.torch.codegen": "torch:eager", "linnet.backends.xla.codegen": "xla:jax",
            "linnet.backends.xla.stablehlo": "xla:stablehlo", "linnet.backends.onnx.graph": "onnx:cpu"}
PRIMITIVES_AND_KERNELS = frozenset(k for k, d in OPS.items() if d.tier != "composite")


@pytest.mark.parametrize("module", EMITTERS)
def test_every_emitter_covers_every_op(module):
    """Every op, but those the backend's registry entry says it does not run yet (and refuses by name)."""
    try:
        native = importlib.import_module(module).NATIVE_OPS
    except ImportError as e:
        pytest.skip(f"{module}: {e}")
    assert set(uncovered(set(native))) == get_backend(EMITTERS[module]).not_yet() & set(OPS)


def test_what_a_backend_does_not_run_yet_it_refuses_by_name():
    from test_builder import spec_of

    spec = spec_of("gptoss-sinks-window5")
    assert get_backend("onnx:cuda").refusal(spec) == ("backend onnx:cuda does not run GptOssForCausalLM yet: not "
                                                      "yet the moe op (a mixture of experts) or attention sinks")
    assert get_backend("torch:eager").refusal(spec) is None
    assert get_backend("onnx:cpu").refusal(spec_of("llama-gqa3")) is None


def test_the_reference_runs_every_op_natively():
    assert set(OPS) <= set(REFERENCE_OPS)


def test_only_composites_have_decompositions():
    for kind, definition in OPS.items():
        assert (definition.decompose is not None) == (definition.tier == "composite"), kind


@pytest.mark.parametrize("case", [c for c in FAMILY_CASES if c.id in ("granite-multipliers", "gemma2-softcap-window6",
                                                                        "gptneox-parallel")], ids=lambda c: c.id)
def test_decompositions_compute_what_their_composites_do(case):
    """Granite (swiglu), Gemma 2 (softcaps), GPT-NeoX (LayerNorms) through the reference interpreter,
    as built and with every composite lowered to primitives: the same logits."""
    from test_builder import spec_of

    spec = spec_of(case.id)
    program = build_program(spec)
    lowered = lower(program, PRIMITIVES_AND_KERNELS)
    assert {op.kind for s in lowered.sections().values() for op in s.ops} <= PRIMITIVES_AND_KERNELS
    composites = {op.kind for s in program.sections().values() for op in s.ops if OPS[op.kind].tier == "composite"}
    assert composites  # the case exercises at least one
    rng = np.random.default_rng(0)
    weights = {n: rng.normal(1.0 if "norm" in n else 0.0, 0.3, s).astype(np.float32)
               for n, s in expected_shapes(spec).items()}
    positions = 16
    cos, sin = rope_tables(spec, positions)
    inputs = {"tokens": rng.integers(0, spec.vocab_size, (1, 9)), "positions": np.arange(9)[None],
              "rows": np.array([0]), "select": np.arange(9)[None], "rope_cos": cos, "rope_sin": sin}
    cache = np.zeros((1, spec.num_kv_heads, positions, spec.head_dim), np.float32)
    caches = ([cache] * spec.num_layers, [cache] * spec.num_layers)
    want, _, _ = run_step(program, weights, inputs, caches)
    got, _, _ = run_step(lowered, weights, inputs, caches)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)

"""Each architecture's Program, pinned as text (a builder change shows in review), and the layer kinds
the families need.

Regenerate the golden texts after an intended change with ``LINNET_UPDATE_GOLDEN=1 pytest tests/program``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from checkpoints import CASE_IDS, CASES_BY_ID, MOE_CASE_IDS, config_class, hf_config

from linnet.program import build_program
from linnet.spec import spec_from_hf_config

transformers = pytest.importorskip("transformers")
GOLDEN = Path(__file__).parent / "golden"


def spec_of(case_id: str):
    """The spec of a case's config as transformers writes it (its defaults filled in)."""
    case = CASES_BY_ID[case_id]
    config = getattr(transformers, config_class(case))(**hf_config(case))
    return spec_from_hf_config({**config.to_dict(), "architectures": [case.architecture]})


@pytest.mark.parametrize("case_id", CASE_IDS + MOE_CASE_IDS)
def test_program_text_matches_golden(case_id):
    text = str(build_program(spec_of(case_id)))
    golden = GOLDEN / f"{case_id}.txt"
    if os.environ.get("LINNET_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def ops_of(section, kind: str):
    return [op for op in section.ops if op.kind == kind]


def test_gemma2_alternates_sliding_and_global_layers():
    program = build_program(spec_of("gemma2-softcap-window6"))
    assert program.layer_kinds == ("sliding", "full")
    (sliding,), (full,) = ops_of(program.kinds["sliding"], "attention"), ops_of(program.kinds["full"], "attention")
    assert sliding.attrs == {"scale": 24 ** -0.5, "softcap": 2.0, "window": 6}
    assert full.attrs == {"scale": 24 ** -0.5, "softcap": 2.0}
    assert [op.kind for op in program.head.ops][-2:] == ["softcap", "cast"]
    # a norm before and after each sublayer
    assert len(ops_of(program.kinds["full"], "rms_norm")) == 4


def test_smollm3_leaves_rotary_out_of_its_nope_layers():
    program = build_program(spec_of("smollm3-nope"))
    assert program.layer_kinds == ("full", "full-nope")
    assert len(ops_of(program.kinds["full"], "rotary")) == 2 and not ops_of(program.kinds["full-nope"], "rotary")


def test_partial_rotary_rotates_the_leading_dims_only():
    spec = spec_of("gptneox-parallel")
    assert (spec.head_dim, spec.rotary_dim) == (16, 4)
    program = build_program(spec)
    rotary = ops_of(program.layer, "rotary")
    assert all(program.inputs()["rope_cos"].shape == ("P", 4) for _ in rotary)
    splits = [op for op in ops_of(program.layer, "split") if op.attrs["sizes"] == (4, 12)]
    assert len(splits) == 2 and len(ops_of(program.layer, "concat")) == 2


def test_a_tied_head_is_a_weight_alias():
    program = build_program(spec_of("qwen2-tied"))
    assert "lm_head" not in program.expected_shapes()
    assert ops_of(program.head, "linear")[0].inputs[1] == "w.lm_head"


def test_parameter_count_is_what_the_program_reads():
    spec = spec_of("gptneox-parallel")
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**hf_config(CASES_BY_ID["gptneox-parallel"])))
    assert spec.parameter_count() == sum(p.numel() for p in model.parameters())

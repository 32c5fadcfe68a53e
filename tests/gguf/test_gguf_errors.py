"""Bad GGUF input and unwritable output: a LinnetError naming the problem, and nothing half-written."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf_cases import REFUSED

from linnet.errors import LinnetError, UnsupportedModel, WeightError
from linnet.gguf import export as gguf_export
from linnet.gguf.export import export_gguf
from linnet.gguf.reader import ROPE_FACTORS, load_gguf, spec_from_metadata
from linnet.model import open_model
from linnet.spec import RopeSpec


@pytest.fixture(scope="module")
def good_gguf(checkpoint_dir, tmp_path_factory):
    model = open_model(str(checkpoint_dir("qwen3-mqa-tied")))
    return export_gguf(model, tmp_path_factory.mktemp("gguf") / "good.gguf", "f16")


def test_a_name_llama_cpp_would_take_for_phi3_is_refused_without_phi3_tokens(checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir("phi3-partial")))  # the tests' tokenizer has no <unk>
    for name in ("Phi-3.5-mini", "my-phi3"):
        with pytest.raises(UnsupportedModel, match=r"(?s)Phi-3's tokens <unk>.*this vocabulary lacks.*--name"):
            export_gguf(model, tmp_path / "m.gguf", "f32", name=name)
    assert not (tmp_path / "m.gguf").exists()
    with pytest.raises(LinnetError, match="must not be empty"):
        export_gguf(model, tmp_path / "m.gguf", "f32", name=" ")
    assert export_gguf(model, tmp_path / "m.gguf", "f32", name="phi-shaped").is_file()


def test_a_directorys_whole_name_names_the_file(checkpoint_dir, tmp_path):
    """Not its stem: "Qwen2.5-0.5B-Instruct" would be "Qwen2", and "phi-3.5-mini" "phi-3", which llama.cpp
    takes for Phi-3's vocabulary."""
    from linnet.gguf.format import GGUFFile

    dotted = tmp_path / "Qwen2.5-tiny"
    dotted.symlink_to(checkpoint_dir("qwen3-mqa-tied"), target_is_directory=True)
    out = export_gguf(open_model(str(dotted)), tmp_path / "m.gguf", "f16")
    assert GGUFFile(out).metadata["general.name"] == "Qwen2.5-tiny"
    again = export_gguf(open_model(str(out)), tmp_path / "m.2.gguf", "f16")  # a file: its stem
    assert GGUFFile(again).metadata["general.name"] == "m"


def write_gguf(path, arch: str, embed_type: Q = Q.F32, hidden: int = 256, vocab: int = 8, skip: str = "") -> None:
    """A header with every hyper-parameter but ``skip``, and only an embedding tensor, stored as ``embed_type``."""
    writer = GGUFWriter(path, arch)
    for key, value in [("context_length", 64), ("embedding_length", hidden), ("block_count", 1),
                       ("feed_forward_length", 512), ("attention.head_count", 2)]:
        if key != skip:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    block, size = GGML_QUANT_SIZES[embed_type]
    raw = np.zeros((vocab, hidden // block * size), dtype=np.uint8)  # the bytes of an all-zero tensor
    writer.add_tensor("token_embd.weight", raw, raw_dtype=embed_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.001])  # tensor data, the last bytes, the header
def test_truncated_file(keep, good_gguf, tmp_path):
    data = good_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(WeightError, match="truncated"):
        load_gguf(cut)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 certainly a zip file" * 10)
    with pytest.raises(WeightError, match="bad magic"):
        load_gguf(path)
    path.write_bytes(b"")
    with pytest.raises(WeightError, match="not a readable GGUF"):
        load_gguf(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "iq.gguf"
    write_gguf(path, "llama", Q.IQ2_XXS)
    with pytest.raises(WeightError, match=r"'token_embd.weight' is stored as IQ2_XXS.*supported: .*Q4_K"):
        load_gguf(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_gguf(path, "gemma3n")
    with pytest.raises(UnsupportedModel, match="'gemma3n' is not supported; supported: gemma2, gemma3, gpt-oss, "
                                               "gptneox, granite, granitemoe, llama, olmo2, olmoe, phi3, qwen2, "
                                               "qwen2moe, qwen3, qwen3moe, smollm3, stablelm"):
        load_gguf(path)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_llama_cpp_cannot_express_is_refused_by_name(case, checkpoint_dir, tmp_path):
    with pytest.raises(UnsupportedModel, match=REFUSED[case]):
        export_gguf(open_model(str(checkpoint_dir(case))), tmp_path / "m.gguf", "f32")
    assert list(tmp_path.iterdir()) == []


def without_head(spec, weights):
    return replace(spec, tie_word_embeddings=True), {k: v for k, v in weights.items() if k != "lm_head"}


@pytest.mark.parametrize("case, change, message", [
    # what the file would read back as otherwise: a missing softcap is llama.cpp's default of 30
    ("gemma2-headscale", lambda s, w: (replace(s, final_softcap=None), w),
     r"final_softcap=None \(it would read back as 30.0\)"),
    ("olmo2-gqa3", without_head, r"olmo2 graph needs an untied head \(output.weight\)"),
    ("phi3-partial", lambda s, w: (replace(s, layer_types=("sliding",) * 2, sliding_window=5), w),
     "phi3 graph has no sliding-window attention; Phi3ForCausalLM's sliding_window=5"),
    ("gptneox-parallel", lambda s, w: (replace(s, activation="gelu_tanh"), w), "one GELU .*, not gelu_tanh"),
    ("gemma3-local10k", lambda s, w: (replace(s, local_rope=RopeSpec(500.0)), w),
     "gemma3 graph rotates sliding layers by base 10000 without scaling, not this model's local rope"),
])
def test_a_model_the_gguf_would_describe_otherwise_is_refused(case, change, message, gguf_case_dir, tmp_path):
    model = open_model(str(gguf_case_dir(case)))
    spec, weights = change(model.spec, dict(model.weights))
    with pytest.raises(UnsupportedModel, match=message):
        export_gguf(replace(model, spec=spec, weights=weights), tmp_path / "m.gguf", "f32")


YARN = RopeSpec(10000.0, "yarn", 4.0, original_max_positions=64, attention_factor=1.1386294)
LONGROPE = RopeSpec(10000.0, "longrope", original_max_positions=64, attention_factor=1.2,
                    short_factors=(1.0, 2.0, 3.0, 4.0), long_factors=(2.0, 3.0, 4.0, 5.0))


@pytest.mark.parametrize("case, rope, message", [
    ("llama-gqa3", RopeSpec(10000.0, "dynamic", 2.0, original_max_positions=256), "llama.cpp has no dynamic NTK"),
    ("llama-gqa3", replace(LONGROPE, short_factors=(1.0,) * 8, long_factors=(2.0,) * 8),
     "llama.cpp's llama graph has no LongRoPE factors"),
    ("llama-gqa3", replace(YARN, truncate=False), "this model's rope scaling has truncate=false"),
    ("qwen2-tied", replace(YARN, beta_fast=16.0), "qwen2 graph runs YaRN with beta_fast 32 and beta_slow 1, not this "
                                                  "model's 16 and 1"),
])
def test_rope_scaling_llama_cpp_applies_otherwise_is_refused(case, rope, message, checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir(case)))
    with pytest.raises(UnsupportedModel, match=message):
        export_gguf(replace(model, spec=replace(model.spec, rope=rope)), tmp_path / "m.gguf", "f32")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case, rope, change, message", [
    ("qwen2-tied", YARN, {"rope.scaling.yarn_beta_fast": 16.0}, "qwen2.rope.scaling.yarn_beta_fast is 16.0"),
    ("qwen2-tied", YARN, {"rope.scaling.yarn_log_multiplier": 0.1}, "yarn_log_multiplier is 0.1"),
    ("qwen2-tied", RopeSpec(10000.0), {"rope.scaling.attn_factor": 1.5},
     "qwen2.rope.scaling.attn_factor 1.5 scales cos and sin; .* not rope scaling 'none'"),
    ("qwen2-tied", RopeSpec(10000.0), {"rope.scaling.type": "longrope"}, "LongRoPE factors in llama.cpp's qwen2 graph"),
    ("phi3-partial", LONGROPE, {}, r"rope_factors_long.weight has shape \[3\], expected \[4\]"),
    ("phi3-partial", RopeSpec(10000.0), {"rope.scaling.type": "longrope"}, "LongRoPE needs rope_factors_short.weight"),
])
def test_rope_metadata_linnet_cannot_read_as_llama_cpp_does_is_named(case, rope, change, message, checkpoint_dir):
    model = open_model(str(checkpoint_dir(case)))
    spec = replace(model.spec, rope=rope)
    family = spec.family
    meta = {**gguf_export.model_metadata(spec, (2,)), **{f"{family}.{k}": v for k, v in change.items()}}
    shapes = {name: t[2] for name, t in gguf_export._tensors(spec, model.weights, Q.F32).items()}
    tensors = gguf_export._rope_tensors(spec)
    if rope.kind == "longrope":  # one factor short
        tensors[ROPE_FACTORS["long"]] = tensors[ROPE_FACTORS["long"]][:3]
    with pytest.raises((UnsupportedModel, WeightError), match=message):
        spec_from_metadata(meta, shapes, tensors, "x.gguf")


def test_missing_hyper_parameter_or_tensor_is_named(tmp_path):
    path = tmp_path / "partial.gguf"
    write_gguf(path, "qwen2", skip="feed_forward_length")
    with pytest.raises(UnsupportedModel, match="lacks metadata key qwen2.feed_forward_length"):
        load_gguf(path)
    write_gguf(path, "qwen2")
    with pytest.raises(WeightError, match=r"missing weight 'norm' \(expected shape \[256\]\)"):
        load_gguf(path)


def test_unwritable_output(good_gguf, tmp_path):
    model = load_gguf(good_gguf)
    blocker = tmp_path / "file"
    blocker.write_text("a regular file")
    with pytest.raises(LinnetError, match="cannot write"):
        export_gguf(model, blocker / "sub" / "m.gguf", "f16")
    with pytest.raises(LinnetError, match="unknown GGUF type 'q4_k'"):
        export_gguf(model, tmp_path / "m.gguf", "q4_k")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_failed_export_leaves_nothing(good_gguf, tmp_path, monkeypatch):
    model = load_gguf(good_gguf)
    calls = []

    def fail_on_third(array, qtype):
        calls.append(qtype)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return array.astype(np.float32)

    monkeypatch.setattr(gguf_export, "_encode", fail_on_third)
    with pytest.raises(LinnetError, match="No space left"):
        export_gguf(model, tmp_path / "m.gguf", "f32")
    assert list(tmp_path.iterdir()) == []

"""Fuzzing the GGUF reader (``linnet.gguf.format``, ``linnet.gguf.reader``): mutated bytes of a real file,
and real files rewritten with generated metadata."""
from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
from fuzz_harness import clean, fast_and_long, mutated
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from hypothesis import strategies as st

from linnet.errors import WeightError
from linnet.gguf.format import GGUFFile
from linnet.gguf.reader import load_gguf


def read_gguf(path: Path) -> None:
    """Everything Linnet reads of a GGUF: container, spec, weights, tokenizer and chat template."""
    model = load_gguf(path)
    if model.tokenizer is not None:
        model.tokenizer.encode("Hello, world")
        if model.tokenizer.chat_template:
            model.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])


def header_size(path: Path) -> int:
    return min(info.offset for info in GGUFFile(path).tensors.values())


def check_mutation(tiny_gguf: Path, tmp_path: Path, data: st.DataObject) -> None:
    original = tiny_gguf.read_bytes()
    path = tmp_path / "mutated.gguf"
    path.write_bytes(data.draw(mutated(original, focus=header_size(tiny_gguf))))
    clean(lambda: read_gguf(path), path)


test_mutated_gguf, test_mutated_gguf_long = fast_and_long(check_mutation)

# Values of every GGUF type, to put where the reader expects another.
VALUES = st.one_of(
    st.tuples(st.just(GGUFValueType.UINT32), st.integers(0, 2**32 - 1)),
    st.tuples(st.just(GGUFValueType.INT32), st.integers(-2**31, 2**31 - 1)),
    st.tuples(st.just(GGUFValueType.UINT64), st.sampled_from([0, 1, 2**40, 2**64 - 1])),
    st.tuples(st.just(GGUFValueType.FLOAT32), st.floats(width=32)),
    st.tuples(st.just(GGUFValueType.BOOL), st.booleans()),
    st.tuples(st.just(GGUFValueType.STRING), st.text(max_size=12)),
    st.tuples(st.just(GGUFValueType.ARRAY), st.lists(st.integers(0, 2**31 - 1), max_size=5)),
    st.tuples(st.just(GGUFValueType.ARRAY), st.lists(st.text(max_size=5), min_size=1, max_size=5)),
)


def rewrite(source: GGUFFile, out: Path, metadata: dict[str, tuple[GGUFValueType, object]], arch: str) -> None:
    writer = GGUFWriter(out, arch=arch)
    for key, (vtype, value) in metadata.items():
        if vtype == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    for name, info in source.tensors.items():
        writer.add_tensor(name, source.raw(name).view(np.float32).reshape(info.shape),
                          raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def typed(value: object) -> tuple[GGUFValueType, object]:
    """A real metadata value with the GGUF type that writes it back."""
    if isinstance(value, bool):
        return GGUFValueType.BOOL, value
    if isinstance(value, int):
        return GGUFValueType.UINT32, value
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, value
    if isinstance(value, str):
        return GGUFValueType.STRING, value
    return GGUFValueType.ARRAY, value


def check_generated(tiny_gguf: Path, tmp_path: Path, data: st.DataObject) -> None:
    source = GGUFFile(tiny_gguf)
    metadata = {k: typed(v) for k, v in source.metadata.items() if k != "general.architecture"}
    for key in data.draw(st.lists(st.sampled_from(sorted(metadata)), min_size=1, max_size=3)):
        if data.draw(st.booleans()):
            metadata[key] = data.draw(VALUES)
        else:
            metadata.pop(key, None)
    arch = data.draw(st.sampled_from([source.metadata["general.architecture"], "llama", "qwen3", "gpt2", ""]))
    path = tmp_path / "generated.gguf"
    rewrite(source, path, metadata, arch)
    clean(lambda: read_gguf(path), path)


test_generated_gguf, test_generated_gguf_long = fast_and_long(check_generated)


def header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + (3).to_bytes(4, "little") + n_tensors.to_bytes(8, "little") + n_kv.to_bytes(8, "little")


def tensor_info(name: bytes, dims: list[int], type_id: int = 0, offset: int = 0) -> bytes:
    out = len(name).to_bytes(8, "little") + name + len(dims).to_bytes(4, "little")
    out += b"".join(d.to_bytes(8, "little") for d in dims)
    return out + type_id.to_bytes(4, "little") + offset.to_bytes(8, "little")


def test_huge_claims_are_refused_before_anything_is_allocated(tmp_path):
    """A 2^60-element tensor, 2^60 metadata keys, a 2^60-item array: refused, having allocated < 1 MB."""
    cases = {
        "tensor.gguf": header(1, 0) + tensor_info(b"token_embd.weight", [2**30, 2**30]),
        "keys.gguf": header(0, 2**60),
        "array.gguf": header(0, 1) + (1).to_bytes(8, "little") + b"k" + int(GGUFValueType.ARRAY).to_bytes(4, "little")
        + int(GGUFValueType.STRING).to_bytes(4, "little") + (2**60).to_bytes(8, "little"),
        "numbers.gguf": header(0, 1) + (1).to_bytes(8, "little") + b"k" + int(GGUFValueType.ARRAY).to_bytes(4, "little")
        + int(GGUFValueType.UINT64).to_bytes(4, "little") + (2**60).to_bytes(8, "little"),
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data + bytes(64))
        tracemalloc.start()
        try:
            clean(lambda path=path: GGUFFile(path), path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 2**20, (name, peak)
    try:
        GGUFFile(tmp_path / "tensor.gguf")
    except WeightError as e:
        assert "tensor 'token_embd.weight' needs bytes up to" in str(e)

"""Fuzzing the readers of an HF directory (safetensors header and index, config.json, tokenizer files,
chat templates) and of Linnet's own formats that strangers may hand it (registry TOML, results JSON)."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from fuzz_harness import JSON, clean, edited, fast_and_long, mutated
from hypothesis import assume
from hypothesis import strategies as st

from linnet import registry
from linnet.errors import RegistryError
from linnet.files import map_safetensors
from linnet.registry.schema import Entry, check_entry, parse
from linnet.results import from_data, load_results
from linnet.site.render import bundled_results
from linnet.spec import load_spec
from linnet.tokenizer import Tokenizer, load_tokenizer
from linnet.weights import load_safetensors, safetensors_files


def copy(tiny_hf: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    if out.exists():
        shutil.rmtree(out)
    return Path(shutil.copytree(tiny_hf, out))


def read_hf(model: Path) -> None:
    spec = load_spec(model)
    load_safetensors(model, spec)
    tokenizer = load_tokenizer(model)
    tokenizer.encode("Hello, world")
    if tokenizer.chat_template:
        tokenizer.encode_chat([{"role": "user", "content": "Hi"}])


# -- safetensors ------------------------------------------------------------------------------------
def check_safetensors_bytes(tiny_hf: Path, tmp_path: Path, data: st.DataObject) -> None:
    model = copy(tiny_hf, tmp_path)
    path = model / "model.safetensors"
    original = path.read_bytes()
    path.write_bytes(data.draw(mutated(original, focus=8 + struct.unpack_from("<Q", original)[0])))
    clean(lambda: read_hf(model), path)


test_safetensors_bytes, test_safetensors_bytes_long = fast_and_long(check_safetensors_bytes)

ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "F16", "BF16", "F64", "I8", ""]) | JSON,
    "shape": st.lists(st.integers(-2, 2**62), max_size=4) | JSON,
    "data_offsets": st.lists(st.integers(-8, 2**62), max_size=3) | JSON,
})


def check_safetensors_header(tiny_hf: Path, tmp_path: Path, data: st.DataObject) -> None:
    """A real file's header with some tensors' entries replaced by generated ones (the data kept)."""
    model = copy(tiny_hf, tmp_path)
    path = model / "model.safetensors"
    raw = path.read_bytes()
    size = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + size])
    names = sorted(k for k in header if k != "__metadata__")
    for name in data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3)):
        header[name] = data.draw(ENTRY | JSON)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])
    clean(lambda: map_safetensors(path), path)


test_safetensors_header, test_safetensors_header_long = fast_and_long(check_safetensors_header)


def check_index(tiny_hf: Path, tmp_path: Path, data: st.DataObject) -> None:
    model = copy(tiny_hf, tmp_path)
    index = model / "model.safetensors.index.json"
    names = st.sampled_from(["model.safetensors", "../model.safetensors", "", "a/b", "x\x00", "nope"])
    value = data.draw(st.fixed_dictionaries({"weight_map": st.dictionaries(st.text(max_size=8), names | JSON)})
                      | JSON)
    index.write_text(json.dumps(value))
    clean(lambda: safetensors_files(model), index)


test_index, test_index_long = fast_and_long(check_index)


# -- config.json --------------------------------------------------------------------------------------
def check_config(tiny_hf: Path, tmp_path: Path, data: st.DataObject) -> None:
    model = copy(tiny_hf, tmp_path)
    path = model / "config.json"
    config = json.loads(path.read_text())
    small = st.integers(-3, 4) | st.sampled_from([0.5, 2**40, 2**62, float("nan"), float("inf"), "48", True])
    path.write_text(json.dumps(data.draw(edited(config, small | JSON)) if data.draw(st.booleans())
                               else data.draw(JSON)))
    clean(lambda: read_hf(model), model)  # a config at odds with the weights is told by the weights' file


test_config, test_config_long = fast_and_long(check_config)


# -- tokenizer files and chat templates ---------------------------------------------------------------
def check_tokenizer_json(tiny_hf: Path, tmp_path: Path, data: st.DataObject) -> None:
    model = copy(tiny_hf, tmp_path)
    path = model / "tokenizer.json"
    path.write_bytes(data.draw(mutated(path.read_bytes())))
    clean(lambda: read_hf(model), path)


test_tokenizer_json, test_tokenizer_json_long = fast_and_long(check_tokenizer_json)


def check_tokenizer_config(tiny_hf: Path, tmp_path: Path, data: st.DataObject) -> None:
    model = copy(tiny_hf, tmp_path)
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(chat_template="{{ messages[0]['content'] }}", eos_token="<|endoftext|>", bos_token=None)
    template = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["default", "tool_use"]),
                                               "template": st.text(max_size=20) | JSON}), max_size=2)
    path.write_text(json.dumps(data.draw(edited(config, JSON | template))))
    clean(lambda: read_hf(model), model)


test_tokenizer_config, test_tokenizer_config_long = fast_and_long(check_tokenizer_config)

# Pieces of real chat templates, put together at random: most make broken templates, some valid ones.
PIECES = ["{% for message in messages %}", "{% endfor %}", "{{ message['content'] }}", "{{ message.role }}",
          "{% if add_generation_prompt %}", "{% endif %}", "{% else %}", "{{ bos_token }}", "{{ eos_token }}",
          "{{ raise_exception('roles must alternate') }}", "{{ messages[5] }}", "{{ 1 / 0 }}", "{{ 'x' * 10**9 }}",
          "{{ 9 ** 9 ** 9 }}", "{{ strftime_now('%Y') }}", "{{ messages.__class__ }}", "{{ ''.__class__.__mro__ }}",
          "{% set x = namespace(a=1) %}", "{{ x.a }}", "{{ range(10**9) | list }}", "{{ messages | tojson }}",
          "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{{", "}}", "{%", "%}", "<|im_start|>", "\n"]


def check_template(data: st.DataObject) -> None:
    template = "".join(data.draw(st.lists(st.sampled_from(PIECES) | st.text(max_size=6), min_size=1, max_size=8)))
    assume(template)  # an empty one is no template: "this model has no chat template"
    tokenizer = Tokenizer(None, [2], chat_template=template, template_origin="tokenizer_config.json: chat_template")
    clean(lambda: tokenizer.render_chat([{"role": "user", "content": "Hi"}]), "tokenizer_config.json")


test_chat_template, test_chat_template_long = fast_and_long(check_template)


# -- registry TOML and results JSON -------------------------------------------------------------------
def check_registry_text(tmp_path: Path, data: st.DataObject) -> None:
    source = sorted(registry.MODELS_DIR.glob("*.toml"))[data.draw(st.integers(0, 2))]
    path = tmp_path / source.name
    path.write_bytes(data.draw(mutated(source.read_bytes())))
    clean(lambda: registry.load_entry(path), path)


test_registry_text, test_registry_text_long = fast_and_long(check_registry_text)


def check_registry_data(data: st.DataObject) -> None:
    entry = registry.entries()[0]
    import dataclasses
    value = data.draw(edited(dataclasses.asdict(entry)))
    where = "entry.toml"

    def read() -> None:
        check_entry(parse(Entry, value, where, RegistryError), where)

    clean(read, where)


test_registry_data, test_registry_data_long = fast_and_long(check_registry_data)


def check_results_text(tmp_path: Path, data: st.DataObject) -> None:
    source = bundled_results()[data.draw(st.integers(0, 1))]
    path = tmp_path / source.name
    path.write_bytes(data.draw(mutated(source.read_bytes())))
    clean(lambda: load_results(path), path)


test_results_text, test_results_text_long = fast_and_long(check_results_text)


@st.composite
def edited_deep(draw: st.DrawFn, value: object) -> object:
    """``value`` with one place somewhere inside it (a row, a metric, a sample) given another value."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: draw(edited_deep(value[key]))}
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], draw(edited_deep(value[i])), *value[i + 1:]]
    return draw(JSON | st.sampled_from([0, -1, float("nan"), float("inf"), 1e308, "", "x"]))


def check_results_data(data: st.DataObject) -> None:
    source = bundled_results()[data.draw(st.integers(0, 1))]
    value = json.loads(source.read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        value = data.draw(edited_deep(value))
    clean(lambda: from_data(value, source.name), source.name)


test_results_data, test_results_data_long = fast_and_long(check_results_data)

"""Tokenizer: ``tokenizers`` for the text, jinja2 for the chat template, every EOS id collected.

EOS ids may be listed by config.json, generation_config.json and tokenizer_config.json; generation
stops on any of them.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from linnet.errors import UnsupportedModel
from linnet.files import naming, read_json

LONG_TEXT = 65536  # characters: a text this long takes tens of milliseconds to encode


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        eos_ids: Iterable[int],
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
        template_origin: str = "the chat template",
    ):
        self.hf = tokenizer
        self.eos_ids = tuple(dict.fromkeys(eos_ids))  # ordered, unique
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos  # prepend BOS ourselves (GGUF add_bos_token); tokenizer.json does its own
        self.template_origin = template_origin  # the file and field it came from, for its errors

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # A long text through encode_batch, which lets go of the GIL while it works (encode holds it: a 3.5 MB
        # prompt stopped every other thread of linnet serve, its event loop included, for 8 s)
        encoded = (self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0] if len(text) > LONG_TEXT
                   else self.hf.encode(text, add_special_tokens=add_special_tokens))
        ids = encoded.ids
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos = self.hf.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, ids: Iterable[int], skip_special_tokens: bool = True) -> Iterator[str]:
        """Decode token by token, emitting text only once it is whole UTF-8 (never half a character)."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token in ids:
            piece = stream.step(self.hf, token)
            if piece:
                yield piece

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation through the chat template; ``tools`` (the API's tool definitions) as Hugging Face
        templates take them. Messages pass as given: a tool message's ``tool_call_id`` and an assistant's
        ``tool_calls`` reach the template."""
        if not self.chat_template:
            raise UnsupportedModel("this model has no chat template; use a plain prompt instead")
        origin = self.template_origin

        def raise_exception(message: str) -> None:
            raise UnsupportedModel(f"{origin} refuses the conversation: {message}")

        env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt))
        env.filters["tojson"] = _tojson  # as transformers renders it: templates write tools and arguments with it
        try:
            if not isinstance(self.chat_template, str):
                raise TypeError(f"expected a string, got {type(self.chat_template).__name__}")
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except UnsupportedModel:
            raise
        except Exception as e:  # a stranger's program: any error in it is the template's, told in one line
            detail = str(e).splitlines()[0] if str(e).strip() else ""
            raise UnsupportedModel(f"{origin} fails: {type(e).__name__}: {detail}"[:500]) from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template writes the special tokens itself (BOS included), so none are added again.
        ids = self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)
        return ids


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson``: plain JSON, not jinja's HTML-safe one (which writes ``<`` as ``\\u003c``)."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja's sandbox (no attribute access outside it, no mutation, ``range`` bounded), with ``*`` and ``**``
    bounded as well: ``'x' * 10**12`` or ``9**9**9`` in a template would otherwise take all memory or time."""

    intercepted_binops = frozenset({"*", "**"})
    LIMIT = 1_000_000  # items of a repeated string or list; digits of a power, roughly

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        numbers = [v for v in (left, right) if isinstance(v, int)]
        if operator == "*" and (isinstance(left, (str, list, tuple)) or isinstance(right, (str, list, tuple))):
            size = len(left if isinstance(left, (str, list, tuple)) else right)
            if numbers and size * max(numbers[0], 0) > self.LIMIT:
                raise jinja2.sandbox.SecurityError(f"a repetition past {self.LIMIT} items")
        if operator == "**" and len(numbers) == 2 and abs(left) > 1 and right * abs(left).bit_length() > self.LIMIT:
            raise jinja2.sandbox.SecurityError(f"a power of more than {self.LIMIT} bits")
        return super().call_binop(context, operator, left, right)


def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON object; a file that is there but broken is an error naming it."""
    if not path.is_file():
        return {}
    data = read_json(path, UnsupportedModel)
    if not isinstance(data, dict):
        raise UnsupportedModel(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, where: str) -> str | None:
    # tokenizer_config may write a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise UnsupportedModel(f"{where}: expected a token (a string, or an object with its content), got {value!r}")
    return value


def _ids(value: Any, where: str) -> list[int]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(type(i) is int for i in ids):
        raise UnsupportedModel(f"{where}: expected a token id or a list of them, got {value!r}")
    return ids


def _template(value: Any, where: str) -> str | None:
    """A template, or the one named "default" of a list of named templates."""
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if value is not None and not isinstance(value, str):
        raise UnsupportedModel(f"{where}: expected a template (a string), got {type(value).__name__}")
    return value


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Read ``tokenizer.json`` plus the EOS ids and chat template of an HF model directory."""
    with naming(model_dir):
        return _load(Path(model_dir))


def _load(model_dir: Path) -> Tokenizer:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedModel(f"no tokenizer.json in {model_dir}")
    hf = _read_tokenizer(path)
    tok_path, gen_path = model_dir / "tokenizer_config.json", model_dir / "generation_config.json"
    tok_config, gen_config = _read_json(tok_path), _read_json(gen_path)
    config = _read_json(model_dir / "config.json")
    eos_token = _token_text(tok_config.get("eos_token"), f"{tok_path}: eos_token")
    eos_ids = (_ids(gen_config.get("eos_token_id"), f"{gen_path}: eos_token_id")
               + _ids(config.get("eos_token_id"), f"{model_dir / 'config.json'}: eos_token_id"))
    if eos_token is not None and (eos_token_id := hf.token_to_id(eos_token)) is not None:
        eos_ids.append(eos_token_id)
    origin = f"{tok_path}: chat_template"
    template = _template(tok_config.get("chat_template"), origin)
    if template is None and (model_dir / "chat_template.jinja").is_file():
        origin = str(model_dir / "chat_template.jinja")
        try:
            template = (model_dir / "chat_template.jinja").read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise UnsupportedModel(f"{origin}: not UTF-8 text (byte {e.start})") from None
    return Tokenizer(
        hf,
        eos_ids,
        chat_template=template,
        bos_token=_token_text(tok_config.get("bos_token"), f"{tok_path}: bos_token"),
        eos_token=eos_token,
        template_origin=origin,
    )


def _read_tokenizer(path: Path) -> HFTokenizer:
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers reports every problem as a plain Exception, with serde's wording
        detail = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedModel(f"{path}: not a tokenizer that the tokenizers library reads: {detail}"[:500]) from None

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


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        eos_ids: Iterable[int],
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
    ):
        self.hf = tokenizer
        self.eos_ids = tuple(dict.fromkeys(eos_ids))  # ordered, unique
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos  # prepend BOS ourselves (GGUF add_bos_token); tokenizer.json does its own

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
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

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise UnsupportedModel("this model has no chat template; use a plain prompt instead")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template writes the special tokens itself (BOS included), so none are added again.
        ids = self.encode(self.render_chat(messages), add_special_tokens=False)
        return ids


def _raise_template_error(message: str) -> None:
    raise UnsupportedModel(f"chat template error: {message}")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config may write a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Read ``tokenizer.json`` plus the EOS ids and chat template of an HF model directory."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedModel(f"no tokenizer.json in {model_dir}")
    hf = HFTokenizer.from_file(str(path))
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    config = _read_json(model_dir / "config.json")
    gen_config = _read_json(model_dir / "generation_config.json")
    eos_token = _token_text(tok_config.get("eos_token"))
    eos_ids = _ids(gen_config.get("eos_token_id")) + _ids(config.get("eos_token_id"))
    if eos_token is not None and hf.token_to_id(eos_token) is not None:
        eos_ids.append(hf.token_to_id(eos_token))
    template = tok_config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if isinstance(template, list):  # a list of named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(
        hf,
        eos_ids,
        chat_template=template,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=eos_token,
    )

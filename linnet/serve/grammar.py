"""Structured output through llguidance: a grammar (JSON schema, regex, choice, Lark/GBNF) compiled once
per text, and a stateful matcher per request that masks the row's logits (``Constraint``).

llguidance was picked over xgrammar by measurement (docs/SERVE.md): the same mask time on SmolLM2's
vocabulary, and it needs nothing else, where xgrammar's wheel requires torch, transformers and triton.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import numpy as np

from linnet.errors import LinnetError
from linnet.serve.engine import RequestError
from linnet.tokenizer import Tokenizer

GrammarKind = Literal["json_schema", "regex", "choice", "grammar", "lark"]

# JSON as models write it (``json.dumps``'s separators), with no other whitespace: a free run of spaces and
# newlines is a place where a weak model can loop until max_tokens.
JSON_OPTIONS: dict[str, Any] = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
CACHE_SIZE = 128  # compiled grammars kept, by their text


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to follow, and the request field that asked (for its errors).

    ``source`` is a JSON schema (a dict, or JSON text) for json_schema, a regex, a list of strings for
    choice, a Lark or GBNF grammar for grammar, and llguidance's own Lark (``%json`` and all) for lark.
    ``strict``: a JSON schema keyword llguidance does not enforce is refused; otherwise it is ignored."""

    kind: GrammarKind
    source: Any
    field: str
    strict: bool = True

    def grammar(self) -> str:
        """llguidance's grammar text (not yet checked: ``GrammarCompiler`` does that)."""
        try:
            if self.kind == "json_schema":
                options = JSON_OPTIONS | {"lenient": not self.strict}
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=options)  # type: ignore[arg-type]
            if self.kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(self.source))
            if self.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(self.source)
            return llguidance.grammar_from(self.kind, self.source)
        except ValueError as e:  # a schema that is not a JSON object, a GBNF grammar that does not convert
            raise RequestError(f"{self.field}: {_one_line(e)}", self.field.split(".")[0]) from None


class GrammarConstraint:
    """One request's matcher (the engine's ``Constraint``): masks what the grammar forbids next and follows
    each token drawn. The logits may have more rows than the tokenizer has tokens: those stay forbidden."""

    def __init__(self, matcher: llguidance.LLMatcher, tokens: int, eos_ids: tuple[int, ...]):
        self._matcher = matcher
        self._tokens = tokens  # the tokenizer's size: the mask's length
        self._eos, self._other_eos = eos_ids[0], np.array(eos_ids[1:], dtype=np.int64)
        self._bitmask = np.zeros((tokens + 31) // 32, dtype=np.int32)

    def mask(self, logits: np.ndarray) -> None:
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if m.is_error():  # (a limit of the library's, met now): ``accept`` ends this request with the error;
            return  # raised here, it would end every row of the step
        n = min(self._tokens, logits.shape[-1])
        allowed = np.unpackbits(self._bitmask.view(np.uint8), count=n, bitorder="little").view(bool)
        if self._other_eos.size and allowed[self._eos]:  # where the grammar may end, any EOS ends it
            allowed[self._other_eos[self._other_eos < n]] = True
        logits[:n][~allowed] = -np.inf
        logits[n:] = -np.inf

    def accept(self, token: int) -> None:
        if token in self._other_eos:
            token = self._eos
        if not self._matcher.consume_token(token):
            raise LinnetError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """Nothing but the end can follow: the output is complete."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Compiles grammars for one tokenizer and hands each request a matcher of its own. The tokenizer's
    llguidance copy takes about a second to build: it is built at the first request that needs it (on the
    worker thread that reads the body), then kept; compiled grammars are kept by their text (an LRU)."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.tokenizer.vocab_size,
                                                  eos_token=self.tokenizer.eos_ids[0])
            return self._ll

    def literal(self, text: str) -> str:
        """``text`` as a Lark terminal: the special token of that name where the tokenizer has one (a special
        token is no string of bytes to a grammar), a quoted string otherwise."""
        token = self.tokenizer.hf.token_to_id(text)
        if token is not None and self.ll_tokenizer.is_special_token(token):
            return f"<[{token}]>"
        return json.dumps(text)

    def constraint(self, spec: GrammarSpec) -> GrammarConstraint:
        """A fresh matcher for ``spec``; a grammar llguidance cannot compile is a ``RequestError`` (400)
        that names the field and gives llguidance's reason."""
        if not self.tokenizer.eos_ids:  # the grammar ends the output with one
            raise RequestError(f"{spec.field}: structured output needs the model's EOS token, and its tokenizer "
                               "names none", spec.field.split(".")[0])
        return GrammarConstraint(self._template(spec).deep_copy(), self.tokenizer.vocab_size,
                                 self.tokenizer.eos_ids)

    def _template(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        grammar = spec.grammar()
        with self._lock:
            if (matcher := self._compiled.get(grammar)) is not None:
                self._compiled.move_to_end(grammar)
                return matcher
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)  # drops the GIL while it builds
        if matcher.is_error():
            raise RequestError(f"{spec.field}: the grammar library cannot use it: {_one_line(matcher.get_error())}",
                               spec.field.split(".")[0], "invalid_grammar")
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return matcher


def _one_line(e: object) -> str:
    """The library's message in one line (a regex error points at the fault on a line of its own)."""
    return (" ".join(str(e).split()) or type(e).__name__)[:500]

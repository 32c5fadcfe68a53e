"""llama.cpp's prompt-lookup decoding beside ``linnet bench --speculate``: llama-cpp-python's ``Llama`` on
the same GGUF file, decoding plainly and with its ``LlamaPromptLookupDecoding`` drafter (the longest of
the last 1..n tokens found in the context proposes up to k tokens; llama.cpp checks them in one batch).

Greedy on both (temperature 0), stopping and counting as Linnet's generation does (at the tokenizer's
end-of-sequence ids, which are timed but not kept), so the generations are the same work where their
tokens agree.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from linnet.errors import BackendUnavailable, LinnetError


@dataclass(frozen=True)
class PeerGeneration:
    token_ids: list[int]
    decode_tok_s: float


class LlamaCppLookup:
    """Two llama.cpp contexts of one GGUF file: one plain, one drafting by prompt lookup."""

    def __init__(self, path: Path, threads: int, positions: int, draft_tokens: int, ngram: int):
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ModuleNotFoundError as e:
            if e.name is None or not e.name.startswith("llama_cpp"):
                raise
            raise BackendUnavailable("llama-cpp-python is not installed (pip install llama-cpp-python)") from None
        settings: dict[str, Any] = dict(n_ctx=positions, n_threads=threads, n_threads_batch=threads, verbose=False)
        drafter = LlamaPromptLookupDecoding(max_ngram_size=ngram, num_pred_tokens=draft_tokens)
        try:
            self.plain = llama_cpp.Llama(str(path), **settings)
            self.lookup = llama_cpp.Llama(str(path), draft_model=drafter, **settings)
        except ValueError as e:  # llama-cpp-python's word for a file llama.cpp does not load
            raise LinnetError(f"--peer llama.cpp: llama.cpp did not load {path} ({e})") from None
        self.described = (f"llama.cpp (llama-cpp-python {metadata.version('llama_cpp_python')}, "
                          f"LlamaPromptLookupDecoding(max_ngram_size={ngram}, num_pred_tokens={draft_tokens}))")

    def generate(self, prompt: Sequence[int], new_tokens: int, eos_ids: Sequence[int],
                 lookup: bool) -> PeerGeneration:
        llm = self.lookup if lookup else self.plain
        llm.reset()  # no reuse of the previous generation's cache
        tokens: list[int] = []
        first = end = time.perf_counter()
        for i, token in enumerate(llm.generate(list(prompt), top_k=1, temp=0.0, reset=True)):
            end = time.perf_counter()
            if i == 0:
                first = end
            if token in eos_ids:  # as Linnet's generation counts: the end token is timed, not kept
                break
            tokens.append(int(token))
            if len(tokens) >= new_tokens:
                break
        steps = len(tokens) - 1
        return PeerGeneration(tokens, steps / (end - first) if steps > 0 and end > first else 0.0)

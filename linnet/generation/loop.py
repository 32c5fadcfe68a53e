"""``generate``: one request on one cache row, a thin loop over the runner's batched ``step``."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from linnet.backends.runner import OK, Decode, Prefill, RowResult, Runner
from linnet.errors import CacheFull, LinnetError
from linnet.generation.text import TextStream
from linnet.sampling import Sampling
from linnet.tokenizer import Tokenizer

if TYPE_CHECKING:
    from linnet.speculative import Speculator


@dataclass
class GenerationResult:
    """One request's tokens, text and timings."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS or stop string) or "length"
    ttft_s: float = 0.0  # prompt in, first token out
    decode_s: float = 0.0  # from the first token to the last

    @property
    def decode_tok_s(self) -> float:
        steps = len(self.token_ids) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


def generate(
    runner: Runner,
    prompt_ids: Sequence[int],
    max_new_tokens: int = 128,
    sampling: Sampling = Sampling(),
    tokenizer: Tokenizer | None = None,
    eos_ids: Sequence[int] | None = None,
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
    row: int = 0,
    speculator: Speculator | None = None,
) -> GenerationResult:
    """Prefill ``prompt_ids`` into ``row`` and decode until EOS, a stop string or ``max_new_tokens``.

    ``on_text`` receives the text as it becomes safe to show (needs ``tokenizer``). A ``speculator``
    (of this runner, row and sampling) advances the row several tokens a call where its drafts agree.
    """
    if max_new_tokens < 1:
        raise LinnetError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not prompt_ids:
        raise LinnetError("the prompt is empty")
    needed = len(prompt_ids) + max_new_tokens - 1  # the last token is sampled, never fed back
    if needed > runner.cache.positions:
        raise CacheFull(
            f"the prompt's {len(prompt_ids)} tokens and up to {max_new_tokens} new tokens need "
            f"{len(prompt_ids)} + {max_new_tokens} - 1 = {needed} cache positions (the last new token is never "
            f"stored), but the KV cache holds {runner.cache.positions}; shorten the prompt, lower "
            "--max-new-tokens, or raise --cache-positions"
        )
    if (stop or on_text) and tokenizer is None:
        raise LinnetError("stop strings and streamed text need a tokenizer")
    eos = set(tokenizer.eos_ids if eos_ids is None and tokenizer else eos_ids or ())
    stream = TextStream(tokenizer, stop) if tokenizer else None
    out = GenerationResult(prompt_ids=list(prompt_ids))

    start = time.perf_counter()
    runner.reset(row)
    tokens = [_token(runner.step(prefill=[Prefill(row, list(prompt_ids))], sampling={row: sampling}), row)]
    out.ttft_s = time.perf_counter() - start
    first = time.perf_counter()
    while not _take(out, tokens, eos, stream, on_text, max_new_tokens):
        room = max_new_tokens - len(out.token_ids)
        more = speculator.advance([*out.prompt_ids, *out.token_ids], room) if speculator else None
        tokens = more or [_token(runner.step(decode=[Decode(row, out.token_ids[-1])], sampling={row: sampling}), row)]
    out.decode_s = time.perf_counter() - first
    if stream is not None:
        rest = stream.finish()
        if rest and on_text:
            on_text(rest)
        out.text = stream.text
    return out


def _token(results: dict[int, RowResult], row: int) -> int:
    result = results[row]
    if result.status != OK:
        raise LinnetError(result.message)
    assert result.token is not None  # a step that read a whole prompt, or decoded, samples
    return result.token


def _take(out: GenerationResult, tokens: list[int], eos: set[int], stream: TextStream | None,
          on_text: Callable[[str], None] | None, most: int) -> bool:
    """Append ``tokens`` to ``out`` one at a time, streaming their text; whether the request is done
    (EOS, a stop string, or ``most`` tokens: the tokens after that one are dropped)."""
    for token in tokens:
        if token in eos:
            out.finish_reason = "stop"
            return True
        out.token_ids.append(token)
        if stream is not None:
            piece = stream.feed(token)
            if piece and on_text:
                on_text(piece)
            if stream.stopped:
                out.finish_reason = "stop"
                return True
        if len(out.token_ids) == most:
            return True
    return False

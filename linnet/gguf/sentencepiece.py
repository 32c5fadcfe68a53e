"""A GGUF's SentencePiece vocabulary (``tokenizer.ggml.model`` "llama": Llama 2, Mistral, Gemma, Phi-3) as a
``tokenizers`` BPE model, and back.

llama.cpp's SentencePiece tokenizer escapes spaces as "▁" (after one leading space, at the start and after
each special token, where ``tokenizer.ggml.add_space_prefix``, true unless the file says otherwise), splits
the text between special tokens into characters and merges, again and again, the adjacent pair whose
joined text is a token of the highest score; a character that is no token is spelt as its UTF-8 bytes'
tokens (``<0x0A>``). A BPE model does the same
when it holds a merge for every way to split each token into two tokens, ranked by the joined token's
score, and falls back to bytes. Only normal tokens are merged into: control, user-defined, byte and
unknown tokens come from the text whole (the first two as added tokens) or from the fallback.

Written back, a BPE with byte fallback over "▁"-escaped text (as transformers converts a SentencePiece
model, and as this module reads one) gets scores from its merges' ranks: the token the first merge makes
scores highest, so llama.cpp merges in the BPE's order. A normal token no merge makes scores below them all.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gguf import TokenType
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from linnet.errors import UnsupportedModel

SPACE = "▁"


def sentencepiece_model(meta: dict[str, Any]) -> HFTokenizer:
    """The tokenizer, without its special tokens and post-processor, of a "llama" GGUF vocabulary."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores: list[float] = meta.get("tokenizer.ggml.scores") or []
    if len(scores) != len(tokens):
        raise UnsupportedModel(f"the GGUF's SentencePiece vocabulary has {len(tokens)} tokens and {len(scores)} "
                               "scores (tokenizer.ggml.scores); it needs one each")
    types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}  # a repeated string maps to its last id, as in llama.cpp
    normal = {t for t, kind in zip(tokens, types) if kind == TokenType.NORMAL}
    ranked = []
    for token in normal:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[vocab[token]], vocab[token], cut, left, right))
    ranked.sort()  # the highest score first; a tie goes by the token's id, then the cut
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab, [(left, right) for *_, left, right in ranked], byte_fallback=True,
                       unk_token=None if unknown is None else tokens[unknown], fuse_unk=True)
    hf = HFTokenizer(model)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    # as llama.cpp: each stretch of text between special tokens gets the space, even one that starts with
    # a space; no pre-tokenizer: the stretch is merged whole
    escape = normalizers.Replace(" ", SPACE)
    hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return hf


BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


@dataclass(frozen=True)
class SpeltVocab:
    scores: list[float]
    space_prefix: bool  # tokenizer.ggml.add_space_prefix


def sentencepiece_vocab(hf: HFTokenizer, tokens: list[str], types: list[int], merges: list[str]) -> SpeltVocab:
    """Scores and the leading space for a BPE with byte fallback written as a "llama" GGUF vocabulary; marks
    its byte tokens (``<0x0A>``) as such in ``types``, in place. Refuses one that does not escape spaces as
    "▁" (then it is no SentencePiece model llama.cpp would tokenize the same)."""
    pieces = hf.encode("a b", add_special_tokens=False).tokens
    if not any(piece.startswith(SPACE) and piece.endswith("b") for piece in pieces):
        raise UnsupportedModel(f"a BPE tokenizer with byte fallback that does not spell a space as {SPACE!r} "
                               f"(it splits 'a b' as {pieces}) cannot be written to GGUF: llama.cpp's "
                               "SentencePiece tokenizer would split text differently")
    first = hf.encode("a", add_special_tokens=False).tokens
    space_prefix = bool(first) and first[0].startswith(SPACE)
    made: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        made.setdefault(merge.replace(" ", "", 1), rank)
    scores = []
    for i, token in enumerate(tokens):
        if types[i] == TokenType.NORMAL and BYTE_TOKEN.fullmatch(token):
            types[i] = int(TokenType.BYTE)
        if token in made:
            scores.append(-float(made[token]))
        elif types[i] == TokenType.NORMAL and len(token) > 1:
            scores.append(-float(len(merges) + 1))
        else:
            scores.append(0.0)
    return SpeltVocab(scores, space_prefix)

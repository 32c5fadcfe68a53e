"""GGUF vocabularies <-> ``tokenizers`` byte-level BPE (and SentencePiece: ``sentencepiece``).

llama.cpp names each BPE pre-tokenizer (``tokenizer.ggml.pre``) and splits text with a fixed list of
regexes per name (``llama-vocab.cpp``); PRE_TOKENIZERS holds the same regexes, applied in the same
order, for the names Linnet supports. Writing a GGUF, the name is found by behaviour: the candidate
that splits a probe text exactly as the tokenizer does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gguf import GGUFWriter, TokenType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from linnet.errors import UnsupportedModel
from linnet.gguf.sentencepiece import sentencepiece_model, sentencepiece_vocab
from linnet.tokenizer import Tokenizer

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

# name -> (regexes applied in turn, ignore_merges: a word already in the vocabulary is one token)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "smollm": ((r"\p{N}", _GPT2), False),
    "qwen2": ((_QWEN2,), False),
    "llama-bpe": ((_LLAMA3,), True),
    "gpt-2": ((_GPT2,), False),
}
# Other names llama.cpp gives the same regexes.
_ALIASES = {"llama3": "llama-bpe", "llama-v3": "llama-bpe", "starcoder": "smollm", "deepseek-r1-qwen": "qwen2"}
_PROBE = "Hello world! DON'T we'll 12345 3.14\n\n  indented\tx  héllo 日本語 ✓?!  \r\nend  "


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    regexes, _ = PRE_TOKENIZERS[name]
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF's ``tokenizer.*`` metadata describes: ``gpt2`` byte-level BPE, or ``llama``
    SentencePiece (``linnet.gguf.sentencepiece``)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2', byte-level BPE, "
                               "and 'llama', SentencePiece)")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise UnsupportedModel("the GGUF names a tokenizer but lists no tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    name = None
    if kind == "llama":
        hf = sentencepiece_model(meta)
    else:
        pre = meta.get("tokenizer.ggml.pre")
        name = _ALIASES.get(pre, pre) if isinstance(pre, str) else pre
        if name not in PRE_TOKENIZERS:
            known = sorted([*PRE_TOKENIZERS, *_ALIASES])
            raise UnsupportedModel(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(known)}")
        vocab = {token: i for i, token in enumerate(tokens)}  # a repeated string maps to its last id, as llama.cpp
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        try:
            hf = HFTokenizer(models.BPE(vocab, merges, ignore_merges=PRE_TOKENIZERS[name][1]))
        except Exception as e:  # tokenizers reports inconsistent merges as a plain Exception
            raise UnsupportedModel(f"GGUF vocabulary is inconsistent: {e}") from None
        hf.pre_tokenizer = _pre_tokenizer(name)
        hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == TokenType.CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED])

    def token(key: str) -> int | None:
        return meta.get(f"tokenizer.ggml.{key}_token_id")

    bos, eos = token("bos"), token("eos")
    # llama.cpp prepends BOS for llama-bpe and SentencePiece unless the file says otherwise; here
    # tokenizer.json does it, so an HF export of this tokenizer behaves the same.
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or name == "llama-bpe") and bos is not None:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)])
    return Tokenizer(
        hf,
        [i for i in (eos, token("eot"), token("eom")) if i is not None],
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=None if bos is None else tokens[bos],
        eos_token=None if eos is None else tokens[eos],
    )


@dataclass
class GGUFVocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    add_bos: bool
    model: str = "gpt2"  # tokenizer.ggml.model: "gpt2" byte-level BPE, or "llama" SentencePiece with these:
    scores: list[float] | None = None
    space_prefix: bool = False
    unknown: int | None = None

    def write(self, writer: GGUFWriter) -> None:
        """The ``tokenizer.ggml.*`` keys of this vocabulary (the token ids of its ends are the model's)."""
        writer.add_tokenizer_model(self.model)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is None:
            writer.add_tokenizer_pre(self.pre)
            writer.add_token_merges(self.merges)
        else:
            writer.add_token_scores(self.scores)
            writer.add_add_space_prefix(self.space_prefix)
            if self.unknown is not None:
                writer.add_unk_token_id(self.unknown)
        writer.add_add_bos_token(self.add_bos)


def gguf_vocab(tokenizer: Tokenizer, vocab_size: int) -> GGUFVocab:
    """A BPE tokenizer as GGUF lists it, one token per model row (padding rows unused): byte-level BPE as
    ``gpt2``, a BPE with byte fallback over "▁"-escaped text (a SentencePiece model's) as ``llama``."""
    model = json.loads(tokenizer.hf.to_str())["model"]
    if model.get("type") != "BPE":
        raise UnsupportedModel(f"only BPE tokenizers can be written to GGUF, not {model.get('type')!r}")
    ids = tokenizer.hf.get_vocab(with_added_tokens=True)
    if max(ids.values()) >= vocab_size:
        raise UnsupportedModel(f"the tokenizer has ids up to {max(ids.values())}, past the model's {vocab_size} rows")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]  # as llama.cpp's converter pads
    types = [int(TokenType.UNUSED)] * vocab_size
    for token, i in ids.items():
        tokens[i], types[i] = token, int(TokenType.NORMAL)
    for i, added in tokenizer.hf.get_added_tokens_decoder().items():
        types[i] = int(TokenType.CONTROL if added.special else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    bos = None if tokenizer.bos_token is None else tokenizer.hf.token_to_id(tokenizer.bos_token)
    add_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]
    if model.get("byte_fallback"):
        unknown = ids.get(model["unk_token"]) if model.get("unk_token") is not None else None
        if unknown is not None:
            types[unknown] = int(TokenType.UNKNOWN)
        spelt = sentencepiece_vocab(tokenizer.hf, tokens, types, merges)
        return GGUFVocab(tokens, types, [], "", add_bos, "llama", spelt.scores, spelt.space_prefix, unknown)
    return GGUFVocab(tokens, types, merges, _pre_name(tokenizer.hf, bool(model.get("ignore_merges"))), add_bos)


def _pre_name(hf: HFTokenizer, ignore_merges: bool) -> str:
    if hf.pre_tokenizer is not None:
        pieces = [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(_PROBE)]
        for name, (_, ignores) in PRE_TOKENIZERS.items():
            if ignores == ignore_merges and [p for p, _ in _pre_tokenizer(name).pre_tokenize_str(_PROBE)] == pieces:
                return name
    raise UnsupportedModel(
        "the tokenizer splits text like none of the llama.cpp pre-tokenizers Linnet writes "
        f"({', '.join(PRE_TOKENIZERS)}), so llama.cpp would tokenize differently"
    )

"""GGUF SentencePiece vocabularies ("llama": Llama 2, Mistral, Gemma, Phi-3) read as llama.cpp tokenizes them.

The vocabulary is a real SentencePiece BPE model trained here on a small text (byte fallback, a user-defined
symbol), written to a vocabulary-only GGUF as llama.cpp's converter writes one; llama.cpp itself
(llama-cpp-python, ``vocab_only``) is the reference, with and without the leading space
(``tokenizer.ggml.add_space_prefix``: Llama 2's files have it, Gemma's not).
"""
from __future__ import annotations

import io
from pathlib import Path

import pytest
from gguf import GGUFWriter

from linnet.errors import UnsupportedModel
from linnet.gguf.format import GGUFFile
from linnet.gguf.tokenizer import GGUFVocab, gguf_vocab, tokenizer_from_gguf

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)")
sentencepiece = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")
pytestmark = pytest.mark.llamacpp

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, hello again.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 12345, 3.14159, 1,000,000 and 42.",
    "The capital of France is Paris; the capital of Italy is Rome.",
    "tokenizers merge pairs of pieces again and again",
] * 20
TEXTS = [
    "The quick brown fox", "Hello world!  Two  spaces\n\nand newlines\tand a tab", "   leading spaces",
    "trailing spaces   ", "x", "héllo 日本語 ✓ 🦜: no such pieces, spelt in bytes", "12345 3.14159",
    "def add(a, b):\n    return a + b\n", "a <tool> call <s> with special text", "</s>", "",
]


def _vocabulary() -> tuple[list[str], list[float], list[int]]:
    from sentencepiece import sentencepiece_model_pb2

    written = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=written, vocab_size=400, model_type="bpe",
        byte_fallback=True, user_defined_symbols=["<tool>"], character_coverage=1.0, minloglevel=2)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(written.getvalue())
    return ([p.piece for p in proto.pieces], [p.score for p in proto.pieces], [int(p.type) for p in proto.pieces])


@pytest.fixture(scope="module")
def vocabulary():
    return _vocabulary()


def vocabulary_file(path: Path, vocab: GGUFVocab, bos: int, eos: int) -> Path:
    """A vocabulary-only GGUF holding ``vocab`` as an export writes it (and a header llama.cpp reads)."""
    writer = GGUFWriter(str(path), "llama")
    for add, value in (("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("head_count", 2)):
        getattr(writer, f"add_{add}")(value)
    writer.add_layer_norm_rms_eps(1e-6)
    vocab.write(writer)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_vocabulary(path: Path, vocabulary, space_prefix: bool, scores: list[float] | None = None) -> Path:
    """The trained vocabulary as llama.cpp's converter writes a SentencePiece model."""
    tokens, their_scores, types = vocabulary
    vocab = GGUFVocab(tokens, types, [], "", True, "llama", their_scores if scores is None else scores,
                      space_prefix, tokens.index("<unk>"))
    return vocabulary_file(path, vocab, tokens.index("<s>"), tokens.index("</s>"))


@pytest.mark.parametrize("space_prefix", [True, False], ids=["space-prefix", "no-space-prefix"])
def test_texts_tokenize_as_llama_cpp_tokenizes_them(vocabulary, tmp_path, space_prefix):
    path = write_vocabulary(tmp_path / "vocab.gguf", vocabulary, space_prefix)
    ours = tokenizer_from_gguf(GGUFFile(path).metadata)
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert ours.encode(text) == theirs.tokenize(text.encode(), add_bos=True, special=True), text
    byte_token = vocabulary[0].index("<0xE6>")  # 日 is no piece: its UTF-8 bytes are
    assert byte_token in ours.encode("日")
    for text in TEXTS:
        if "<" not in text:  # special tokens are dropped in decoding
            assert ours.decode(ours.encode(text)) == text


def test_a_vocabulary_without_a_score_each_is_refused(vocabulary, tmp_path):
    path = write_vocabulary(tmp_path / "vocab.gguf", vocabulary, True, scores=vocabulary[1][:-1])
    with pytest.raises(UnsupportedModel, match=r"400 tokens and 399 scores \(tokenizer.ggml.scores\)"):
        tokenizer_from_gguf(GGUFFile(path).metadata)


def write_back(path: Path, tokenizer, rows: int) -> Path:
    """``tokenizer`` written as an export writes it, in a vocabulary-only GGUF."""
    return vocabulary_file(path, gguf_vocab(tokenizer, rows), tokenizer.hf.token_to_id(tokenizer.bos_token),
                           tokenizer.eos_ids[0])


@pytest.mark.parametrize("space_prefix", [True, False], ids=["space-prefix", "no-space-prefix"])
def test_a_sentencepiece_vocabulary_is_written_back_as_llama_cpp_reads_it(vocabulary, tmp_path, space_prefix):
    """Read, then written as ``linnet export gguf`` writes it (scores from the merges' ranks, byte tokens
    typed as bytes, the unknown token and the leading space kept): llama.cpp tokenizes as with the original."""
    original = write_vocabulary(tmp_path / "original.gguf", vocabulary, space_prefix)
    tokenizer = tokenizer_from_gguf(GGUFFile(original).metadata)
    again = write_back(tmp_path / "again.gguf", tokenizer, 400)
    meta = GGUFFile(again).metadata
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] == space_prefix
    assert meta["tokenizer.ggml.token_type"][vocabulary[0].index("<0x0A>")] == 6  # TokenType.BYTE
    unknown = vocabulary[0].index("<unk>")
    assert meta["tokenizer.ggml.unknown_token_id"] == unknown and meta["tokenizer.ggml.token_type"][unknown] == 2
    theirs, ours = (llama_cpp.Llama(str(p), vocab_only=True, verbose=False) for p in (original, again))
    for text in TEXTS:
        ids = theirs.tokenize(text.encode(), add_bos=True, special=True)
        assert ours.tokenize(text.encode(), add_bos=True, special=True) == ids, text
        assert ours.detokenize(ids) == theirs.detokenize(ids), text


def test_a_byte_fallback_bpe_that_keeps_spaces_is_not_written_as_sentencepiece(vocabulary, tmp_path):
    tokenizer = tokenizer_from_gguf(GGUFFile(write_vocabulary(tmp_path / "vocab.gguf", vocabulary, True)).metadata)
    tokenizer.hf.normalizer = None  # spaces stay spaces: no SentencePiece model splits text so
    with pytest.raises(UnsupportedModel, match="does not spell a space as '▁'"):
        gguf_vocab(tokenizer, 400)

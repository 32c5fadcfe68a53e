from __future__ import annotations

import pytest

from linnet.generation import TextStream
from linnet.model import open_model

TEXT = "Héllo wörld, ünïcode ✓ 日本語. The quick brown fox."


@pytest.fixture(scope="module")
def tokenizer(checkpoint_dir):
    return open_model(str(checkpoint_dir("qwen2-tied"))).tokenizer


def test_stream_never_emits_half_a_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.encode()) // 4  # the multi-byte characters span several tokens
    stream = TextStream(tokenizer)
    pieces = [stream.feed(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.finish() == TEXT


def test_stop_string_across_tokens_is_cut_and_never_shown(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stream = TextStream(tokenizer, stop=["brown"])
    shown = ""
    for t in ids:
        shown += stream.feed(t)
        assert "bro" not in shown or "brown" not in shown
        if stream.stopped:
            break
    assert stream.stopped
    assert shown == TEXT[: TEXT.index("brown")] == stream.text


def test_a_near_miss_is_released(tokenizer):
    ids = tokenizer.encode("The quick brown fox.", add_special_tokens=False)
    stream = TextStream(tokenizer, stop=["quiet"])
    shown = "".join(stream.feed(t) for t in ids) + stream.finish()
    assert not stream.stopped and shown == "The quick brown fox."

from __future__ import annotations

import pytest

from linnet.backends import CacheShape, create_runner
from linnet.errors import CacheFull, LinnetError
from linnet.generation import Sampling, generate
from linnet.model import open_model


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return open_model(str(checkpoint_dir("qwen3-gqa3")))


@pytest.fixture(scope="module")
def runner(model):
    return create_runner("torch:eager", model.weights, CacheShape(rows=2, positions=48))


def test_max_new_tokens_and_timings(runner, model):
    out = generate(runner, [1, 5, 9], max_new_tokens=10, eos_ids=[])
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    assert out.ttft_s > 0 and out.decode_tok_s > 0


def test_stops_on_any_eos_id(runner):
    free = generate(runner, [1, 5, 9], max_new_tokens=10, eos_ids=[])
    # Declare the fourth greedy token an EOS id (among others): generation ends just before it.
    out = generate(runner, [1, 5, 9], max_new_tokens=10, eos_ids=[7777, free.token_ids[3]])
    assert out.token_ids == free.token_ids[:3] and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(runner):
    s = Sampling(temperature=1.0, top_p=0.9, seed=3)
    a = generate(runner, [1, 5, 9], max_new_tokens=12, sampling=s, eos_ids=[]).token_ids
    assert a == generate(runner, [1, 5, 9], max_new_tokens=12, sampling=s, eos_ids=[]).token_ids


def test_streamed_text_equals_the_final_text(runner, model):
    pieces: list[str] = []
    out = generate(runner, [1, 40, 41], max_new_tokens=20, tokenizer=model.tokenizer, eos_ids=[],
                   on_text=pieces.append)
    assert "".join(pieces) == out.text == model.tokenizer.decode(out.token_ids)


def test_prompt_longer_than_the_cache_is_a_clear_error(runner):
    with pytest.raises(CacheFull, match=r"the prompt's 40 tokens and up to 10 new tokens need "
                                        r"40 \+ 10 - 1 = 49 cache positions .*holds 48"):
        generate(runner, [3] * 40, max_new_tokens=10)
    with pytest.raises(CacheFull, match="do not fit"):
        runner.prefill(0, [3] * 49)


def test_bad_tokens_and_rows(runner):
    with pytest.raises(LinnetError, match="outside the vocabulary of 331"):
        runner.prefill(0, [1, 331])
    with pytest.raises(LinnetError, match="row 2 is outside"):
        runner.prefill(2, [1])
    with pytest.raises(LinnetError, match="empty"):
        generate(runner, [], max_new_tokens=3)

"""``Runner.copy_row`` and ``Prefill.forks`` on every backend: a row given another's cache decodes exactly as
that row does, and as a row that read the prompt itself; a fork draws its own first token from the prompt's
logits with its own sampler. Gemma 2's case mixes global layers with sliding ones kept as rings (chunks
of 4 tokens: 9 slots for its window of 6), over a prompt long enough to wrap them.

Compiled backends other than XLA's are slow (inductor compiles each step for tens of seconds); inductor's
copy is torch:eager's, so its second case is left to ``make test-compile``."""
from __future__ import annotations

import numpy as np
import pytest

from linnet.backends import CacheShape, Decode, Prefill, create_runner
from linnet.backends.registry import backends, get_backend
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.sampling import Sampling
from linnet.spec import load_spec

CASES = ("qwen3-gqa3", "gemma2-softcap-window6")
FAST = {"reference:numpy", "torch:eager", "onnx:cpu", "xla:jax", "xla:stablehlo"}


def marks(backend: str, case: str) -> list[pytest.MarkDecorator]:
    if backend in FAST:
        return []
    return [pytest.mark.slow] + ([pytest.mark.compile] if case != CASES[0] else [])


PARAMS = [pytest.param(b.id, case, id=f"{b.id}-{case}", marks=marks(b.id, case))
          for b in backends() if "f32" in b.dtypes for case in CASES]
ROWS, POSITIONS, CHUNK = 3, 64, 4
VOCAB = 331

_runners: dict = {}


def runner_for(checkpoint_dir, backend: str, case: str):
    reason = get_backend(backend).unavailable() or get_backend(backend).refusal(load_spec(checkpoint_dir(case)))
    if reason:
        pytest.skip(f"{backend}: {reason}")
    if (backend, case) not in _runners:
        weights = open_model(str(checkpoint_dir(case))).weights
        _runners[backend, case] = create_runner(backend, weights, CacheShape(ROWS, POSITIONS, chunk=CHUNK))
    runner = _runners[backend, case]
    for row in range(ROWS):
        runner.reset(row)
    return runner


def prompt(n: int, seed: int) -> list[int]:
    return np.random.RandomState(seed).randint(3, VOCAB, size=n).tolist()


def decode_alone(runner, row: int, first: int, steps: int) -> list[np.ndarray]:
    """``steps`` greedy decode steps of ``row`` alone from token ``first``; each step's logits."""
    out, token = [], first
    for _ in range(steps):
        (result,) = runner.step(decode=[Decode(row, token)], logits=True).values()
        out.append(result.logits)
        token = result.token
    return out


@pytest.mark.parametrize(("backend", "case"), PARAMS)
def test_a_copied_row_decodes_as_its_source_and_as_a_row_that_read_the_prompt(checkpoint_dir, backend, case):
    runner = runner_for(checkpoint_dir, backend, case)
    ids = prompt(13, seed=1)  # past the rings' 9 slots
    runner.prefill(2, prompt(30, seed=2))  # the target held something else, longer, before
    last = runner.prefill(0, ids)
    runner.copy_row(0, 2, len(ids))
    assert runner.lengths[2] == len(ids)
    first = int(last.argmax())
    copied = decode_alone(runner, 2, first, 12)
    source = decode_alone(runner, 0, first, 12)
    assert all(np.array_equal(a, b) for a, b in zip(copied, source))  # the same computation, bit for bit
    runner.prefill(1, ids)
    read = decode_alone(runner, 1, first, 12)
    assert max(float(np.abs(a - b).max()) for a, b in zip(copied, read)) <= 1e-5


@pytest.mark.parametrize(("backend", "case"), PARAMS)
def test_forks_draw_their_own_first_tokens_from_the_prompts_logits(checkpoint_dir, backend, case):
    runner = runner_for(checkpoint_dir, backend, case)
    ids = prompt(11, seed=3)
    seeded = {row: Sampling(temperature=1.5, seed=40 + row) for row in range(ROWS)}
    forked = runner.step(prefill=[Prefill(0, ids, forks=(1, 2))], sampling=seeded)
    assert sorted(forked) == [0, 1, 2] and runner.lengths == [len(ids)] * ROWS
    for row in range(ROWS):  # each as a request that read the prompt in its row with its seed
        runner.reset(row)
        alone = runner.step(prefill=[Prefill(row, ids)], sampling={row: seeded[row]})
        assert alone[row].token == forked[row].token
    greedy = runner.step(prefill=[Prefill(0, ids, forks=(2,))])
    assert greedy[0].token == greedy[2].token
    tokens = [greedy[0].token, greedy[2].token]
    for _ in range(5):
        both = runner.step(decode=[Decode(0, tokens[0]), Decode(2, tokens[1])])
        tokens = [both[0].token, both[2].token]
        assert tokens[0] == tokens[1]


@pytest.mark.parametrize(("backend", "case"), [p for p in PARAMS if p.values[0] == "reference:numpy"])
def test_copies_that_cannot_be_made_are_refused(checkpoint_dir, backend, case):
    runner = runner_for(checkpoint_dir, backend, case)
    runner.prefill(0, prompt(12, seed=4))
    with pytest.raises(LinnetError, match="holds 12 positions and cannot give its first 13"):
        runner.copy_row(0, 1, 13)
    with pytest.raises(LinnetError, match="two rows"):
        runner.copy_row(0, 0, 5)
    with pytest.raises(LinnetError, match="outside the cache"):
        runner.copy_row(0, ROWS, 5)
    with pytest.raises(LinnetError, match="a row may appear once"):
        runner.step(prefill=[Prefill(1, [5, 6], forks=(1,))])
    with pytest.raises(LinnetError, match="last chunk"):
        runner.step(prefill=[Prefill(1, [5, 6], sample=False, forks=(2,))])
    if runner.rings:  # a ring that has moved on no longer holds the window before an early length
        assert runner.lengths[0] > max(slots for slots, _ in runner.rings) + 1
        with pytest.raises(LinnetError, match="ring caches no longer hold them"):
            runner.copy_row(0, 1, 2)

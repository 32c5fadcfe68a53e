"""The batched runner step, on every backend: requests joining and leaving rows in any order give the
tokens each gives alone; a full row reports it while its neighbours go on; sampling happens where the
model runs and stays reproducible per row."""
from __future__ import annotations

import numpy as np
import pytest

from linnet.backends import CacheShape, Decode, Prefill, create_runner
from linnet.backends.registry import backends, get_backend
from linnet.backends.runner import BAD_TOKENS, CACHE_FULL, OK, groups_by_length
from linnet.errors import LinnetError
from linnet.generation import Sampling, generate
from linnet.model import open_model

CASE = "qwen3-gqa3"  # q/k norm, head_dim != hidden / heads, GQA 3
ROWS, POSITIONS = 3, 64
STEP_BACKENDS = [b.id for b in backends() if b.id != "torch:cudagraphs"] + ["torch:cudagraphs"]
QUICK = ["reference:numpy", "torch:eager"]


def make_runner(checkpoint_dir, backend: str, rows: int = ROWS, positions: int = POSITIONS):
    reason = get_backend(backend).unavailable()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    return create_runner(backend, open_model(str(checkpoint_dir(CASE))).weights, CacheShape(rows, positions))


def prompt(n: int, seed: int) -> list[int]:
    return np.random.RandomState(seed).randint(3, 331, size=n).tolist()


@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_interleaved_requests_give_the_tokens_each_gives_alone(checkpoint_dir, backend):
    runner = make_runner(checkpoint_dir, backend)
    runner.prefill_chunk = 8  # so the 21-token prompt is prefilled in three chunks
    requests = {name: (prompt(n, seed), new) for name, n, seed, new in [
        ("a", 5, 1, 9), ("b", 21, 2, 6), ("c", 3, 3, 12), ("d", 11, 4, 4), ("e", 7, 5, 8), ("f", 2, 6, 5)]}
    alone = {name: generate(runner, ids, new, eos_ids=[]).token_ids for name, (ids, new) in requests.items()}

    rng = np.random.default_rng(0)
    waiting, running, got = list(requests), {}, {name: [] for name in requests}  # running: row -> name
    while waiting or running:
        free = [r for r in range(ROWS) if r not in running]
        joining = []
        if waiting and free and rng.random() < 0.6:  # a new request takes a free row at a random moment
            name, row = waiting.pop(0), int(rng.choice(free))
            runner.reset(row)
            joining.append(Prefill(row, requests[name][0]))
            running[row] = name
        decoding = [Decode(row, got[name][-1]) for row, name in running.items() if got[name]]
        results = runner.step(prefill=joining, decode=decoding)
        for row, result in results.items():
            assert result.status == OK
            name = running[row]
            got[name].append(result.token)
            if len(got[name]) == requests[name][1]:
                del running[row]  # finished: its row is free at once
    assert got == alone


def test_short_prompts_are_grouped_by_length_within_a_chunk(checkpoint_dir):
    runner = make_runner(checkpoint_dir, "reference:numpy", rows=8)
    runner.prefill_chunk = 16
    entries = [Prefill(0, prompt(5, 0)), Prefill(1, prompt(16, 1)), Prefill(2, prompt(2, 2)),
               Prefill(3, prompt(4, 3), start=3), Prefill(4, prompt(3, 4)), Prefill(5, prompt(9, 5))]
    assert runner.prompt_groups(entries) == [[e] for e in entries]  # the reference reads a row a call
    runner.prompts_together = True
    groups = runner.prompt_groups(entries)
    # 2, 3 and 5 tokens pad to 3 x 5 <= 16; 9 would make 4 x 9; the full chunk and the prompt's second part
    # (it starts at 3) go alone; the calls in the order of their first chunk
    assert [[e.row for e in g] for g in groups] == [[2, 4, 0], [1], [3], [5]]
    assert all(runner.prompt_groups(g) == [g] for g in groups)


def test_short_prompts_split_where_padding_and_calls_cost_least():
    # filling each call shortest first gives [33..49] [58..80]: 196 + 240 padded tokens in two calls
    assert groups_by_length([33, 35, 39, 49, 58, 61, 80], 256, call_tokens=32) == [(0, 3), (3, 6), (6, 7)]
    assert groups_by_length([33, 35, 39, 49, 58, 61, 80], 256, call_tokens=1000) == [(0, 4), (4, 7)]
    assert groups_by_length([40, 40, 40], 256, call_tokens=0) == [(0, 3)]  # ties: fewer calls
    assert groups_by_length([300], 256) == [(0, 1)] and groups_by_length([], 256) == []

    def fits(bounds, lengths, most):
        return all(end - begin == 1 or (end - begin) * lengths[end - 1] <= most for begin, end in bounds)

    def cost(bounds, lengths, call):
        return sum(call + (end - begin) * lengths[end - 1] for begin, end in bounds)

    def every_split(n):  # every way to cut 0..n into consecutive runs
        for cuts in range(2 ** max(n - 1, 0)):
            edges = [0] + [i + 1 for i in range(n - 1) if cuts >> i & 1] + [n]
            yield list(zip(edges, edges[1:]))

    rng = np.random.RandomState(0)
    for _ in range(200):
        lengths = sorted(rng.randint(1, 120, size=rng.randint(1, 9)).tolist())
        most, call = int(rng.randint(60, 300)), int(rng.randint(0, 80))
        got = groups_by_length(lengths, most, call)
        assert [b for b, _ in got] == [0] + [e for _, e in got][:-1] and got[-1][1] == len(lengths)
        assert fits(got, lengths, most)
        best = min(cost(split, lengths, call) for split in every_split(len(lengths)) if fits(split, lengths, most))
        assert cost(got, lengths, call) == best


@pytest.mark.parametrize("backend", QUICK + ["onnx:cpu"])
@pytest.mark.parametrize("rows", [(1, 2, 3, 0), (4, 0, 6, 2)], ids=["rows together", "rows apart"])
def test_short_prompts_read_together_give_what_each_gives_alone(checkpoint_dir, backend, rows):
    together, alone = make_runner(checkpoint_dir, backend, rows=8), make_runner(checkpoint_dir, backend, rows=8)
    together.prompts_together = True
    prompts = [Prefill(row, prompt(n, row)) for row, n in zip(rows, (7, 2, 13, 5))]
    assert len(together.prompt_groups(prompts)) == 1
    got = together.step(prefill=prompts, logits=True)
    want = {p.row: alone.step(prefill=[p], logits=True)[p.row] for p in prompts}
    for _ in range(4):  # the rows' caches hold the prompts, not the pads beyond them
        for row in rows:
            assert got[row].token == want[row].token
            assert np.abs(got[row].logits - want[row].logits).max() <= 1e-4
        got = together.step(decode=[Decode(r, got[r].token) for r in rows], logits=True)
        want = alone.step(decode=[Decode(r, want[r].token) for r in rows], logits=True)
    assert together.lengths == alone.lengths


@pytest.mark.parametrize("backend", QUICK)
def test_a_prompt_split_over_steps_matches_one_prefill(checkpoint_dir, backend):
    runner = make_runner(checkpoint_dir, backend)
    ids = prompt(20, seed=7)
    whole = runner.step(prefill=[Prefill(0, ids)], logits=True)[0]
    first = runner.step(prefill=[Prefill(1, ids[:12], sample=False)])[1]
    assert first.status == OK and first.token is None
    rest = runner.step(prefill=[Prefill(1, ids[12:], start=12)], decode=[Decode(0, whole.token)], logits=True)
    assert rest[1].token == whole.token
    assert np.abs(rest[1].logits - whole.logits).max() <= 1e-4


@pytest.mark.parametrize("backend", ["reference:numpy", "onnx:cpu"])
def test_chunks_whose_logits_nobody_reads_select_no_tokens(checkpoint_dir, backend):
    def spied(runner):  # the real runner, its calls' selected token counts noted
        selected, forward = [], runner._forward
        runner.prefill_chunk = 8

        def note(tokens, positions, rows, select):
            selected.append(None if select is None else select.shape[1])
            return forward(tokens, positions, rows, select)

        runner._forward = note
        return runner, selected

    runner, selected = spied(make_runner(checkpoint_dir, backend))
    assert runner.reads_without_logits
    ids = prompt(20, seed=11)
    first = runner.step(prefill=[Prefill(1, ids[:12], sample=False)])[1]  # chunks of 8 and 4, no token drawn
    assert first.status == OK and first.token is None and selected == [0, 0]
    rest = runner.step(prefill=[Prefill(1, ids[12:], start=12)], logits=True)[1]
    assert selected[2:] == [1]
    alone, selected = spied(make_runner(checkpoint_dir, backend))
    whole = alone.step(prefill=[Prefill(0, ids)], logits=True)[0]  # 8, 8, 4: only the last chunk's logits
    assert selected == [0, 0, 1]
    assert rest.token == whole.token and np.abs(rest.logits - whole.logits).max() <= 1e-4


@pytest.mark.parametrize("backend", QUICK)
def test_a_full_row_reports_it_and_its_neighbours_go_on(checkpoint_dir, backend):
    runner = make_runner(checkpoint_dir, backend, rows=2, positions=16)
    reference = make_runner(checkpoint_dir, backend, rows=2, positions=16)
    long, short = prompt(15, seed=8), prompt(4, seed=9)
    a = runner.step(prefill=[Prefill(0, long), Prefill(1, short)])
    want = reference.step(prefill=[Prefill(1, short)])[1].token
    assert a[1].token == want
    b = runner.step(decode=[Decode(0, a[0].token), Decode(1, a[1].token)])  # row 0 fills its 16th position
    want = reference.step(decode=[Decode(1, want)])[1].token
    assert b[0].status == OK and b[1].token == want
    c = runner.step(decode=[Decode(0, b[0].token), Decode(1, b[1].token)])
    want = reference.step(decode=[Decode(1, want)])[1].token
    assert c[0].status == CACHE_FULL and c[0].token is None and "16 positions" in c[0].message
    assert c[1].status == OK and c[1].token == want
    assert runner.lengths == [16, 6]
    bad = runner.step(prefill=[Prefill(0, [5, 331])], decode=[Decode(1, c[1].token)])
    assert bad[0].status == BAD_TOKENS and "outside the vocabulary of 331" in bad[0].message
    assert bad[1].status == OK


@pytest.mark.parametrize("backend", QUICK)
def test_seeded_sampling_is_the_same_through_step_and_generate(checkpoint_dir, backend):
    runner = make_runner(checkpoint_dir, backend)
    sampling = Sampling(temperature=1.0, top_p=0.95, seed=11)
    ids = prompt(6, seed=10)
    want = generate(runner, ids, 12, sampling, eos_ids=[]).token_ids
    # Through the batched step, in row 2, while row 0 decodes greedily and row 1 samples unseeded beside it.
    runner.reset(0), runner.reset(1), runner.reset(2)
    noisy = Sampling(temperature=1.5)
    out = runner.step(prefill=[Prefill(0, prompt(9, 1)), Prefill(1, prompt(4, 2)), Prefill(2, ids)],
                      sampling={1: noisy, 2: sampling})
    got = [out[2].token]
    while len(got) < 12:
        out = runner.step(decode=[Decode(r, out[r].token) for r in range(3)], sampling={1: noisy, 2: sampling})
        got.append(out[2].token)
    assert got == want
    other = generate(runner, ids, 12, Sampling(temperature=1.0, top_p=0.95, seed=12), eos_ids=[]).token_ids
    assert other != want


@pytest.mark.parametrize("backend", QUICK)
def test_top_k_and_top_p_restrict_the_draw(checkpoint_dir, backend):
    runner = make_runner(checkpoint_dir, backend)
    ids = prompt(5, seed=12)
    seen = {"k": set(), "p": set()}
    for seed in range(40):
        top_k = runner.step(prefill=[Prefill(0, ids)], sampling={0: Sampling(2.0, top_k=3, seed=seed)}, logits=True)[0]
        seen["k"].add(top_k.token)
        top_p = runner.step(prefill=[Prefill(0, ids)], sampling={0: Sampling(1.0, top_p=0.3, seed=seed)})[0]
        seen["p"].add(top_p.token)
    logits = top_k.logits.astype(np.float64)
    ranked = list(np.argsort(-logits))
    assert seen["k"] <= set(ranked[:3]) and len(seen["k"]) >= 2  # temperature 2: more than one of the three
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    nucleus = set(ranked[:int(np.searchsorted(np.cumsum(probs[ranked]), 0.3)) + 1])
    assert seen["p"] <= nucleus


@pytest.mark.parametrize("backend", QUICK)
def test_a_decode_step_brings_back_token_ids_not_logits(checkpoint_dir, backend):
    runner = make_runner(checkpoint_dir, backend, rows=8, positions=32)
    first = runner.step(prefill=[Prefill(r, prompt(3, r)) for r in range(8)])

    def no_logits(array):
        raise AssertionError("a step asked for no logits, yet logits were copied to the host")

    runner._to_host = no_logits
    out = runner.step(decode=[Decode(r, first[r].token) for r in range(8)], sampling={3: Sampling(1.0, seed=1)})
    assert sorted(out) == list(range(8)) and all(isinstance(r.token, int) for r in out.values())


def test_rows_named_twice_or_out_of_range_are_errors(checkpoint_dir):
    from linnet.errors import LinnetError

    runner = make_runner(checkpoint_dir, "reference:numpy")
    with pytest.raises(LinnetError, match="once per step"):
        runner.step(prefill=[Prefill(0, [3])], decode=[Decode(0, 4)])
    with pytest.raises(LinnetError, match="row 5 is outside"):
        runner.step(decode=[Decode(5, 4)])


def test_an_option_a_backend_does_not_take_is_named(checkpoint_dir):
    from linnet.errors import LinnetError

    weights = open_model(str(checkpoint_dir(CASE))).weights
    with pytest.raises(LinnetError, match="reference:numpy has no option devices; it takes none"):
        create_runner("reference:numpy", weights, CacheShape(1, 16), devices=2)


@pytest.mark.parametrize("backend", QUICK + ["onnx:cpu"])  # onnx:cpu's reads on a scratch and writes every page
def test_warming_up_touches_no_row(checkpoint_dir, backend):
    runner = make_runner(checkpoint_dir, backend)
    ids = prompt(9, seed=13)
    want = generate(runner, ids, 6, eos_ids=[]).token_ids
    runner.reset(0)
    runner.step(prefill=[Prefill(0, ids[:5])])
    unwarmed = runner.step(prefill=[Prefill(0, ids[5:], start=5)], logits=True)[0].logits
    runner.reset(0)
    runner.step(prefill=[Prefill(0, ids[:5])])
    assert runner.warm_up() >= 0
    out = runner.step(prefill=[Prefill(0, ids[5:], start=5)], logits=True)[0]
    assert np.array_equal(out.logits, unwarmed)  # the row's cache is as it was, to the bit: not only its tokens
    got = [out.token]
    while len(got) < 6:
        got.append(runner.step(decode=[Decode(0, got[-1])])[0].token)
    assert got == want


def test_ring_caches_refuse_what_they_cannot_serve(checkpoint_dir):
    """A ring of 8 (window 5, chunks of 4) holds a row's last 8 positions: a prefill may go back 4 of them,
    not 5, and the chunk may not grow past the 4 the rings were sized for."""
    weights = open_model(str(checkpoint_dir("mistral-window5"))).weights
    runner = create_runner("reference:numpy", weights, CacheShape(1, POSITIONS, chunk=4))
    assert runner.rings == {(8, 5)}
    ids = prompt(20, 0)
    want = runner.prefill(0, ids)
    assert np.abs(runner.prefill(0, ids[16:], start=16) - want).max() <= 1e-5  # positions 12-15 are still held
    with pytest.raises(LinnetError, match="no longer hold the 4 before it"):
        runner.prefill(0, ids[15:], start=15)
    runner.prefill_chunk = 8
    with pytest.raises(LinnetError, match="sized for"):
        runner.prefill(0, ids)

"""The serving benchmark end to end: real `linnet serve` processes on loopback, driven over HTTP by the
bench's client, on a tiny checkpoint and a tiny profile."""
from __future__ import annotations

import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from linnet.bench import arithmetic
from linnet.bench.serving import (
    PROFILES,
    Prompts,
    ServingProfile,
    random_load,
    random_prompts,
    run_server,
    same_run_baseline,
    serving_results,
    serving_rows,
    workload_load,
)
from linnet.bench.serving_client import OPENAI, TRITON, read_chunk
from linnet.bench.serving_servers import NotRunnable, make_server, server_ids, vllm_kv_cache_bytes
from linnet.bench.workloads import workload_prompts
from linnet.cli import build_parser
from linnet.commands.bench_serve import profile_of
from linnet.errors import LinnetError
from linnet.model import open_model, open_spec
from linnet.results import load_results, save_results
from linnet.site.render import render_site

CASE = "qwen2-tied"  # max_position_embeddings 256
TINY = ServingProfile("tiny", requests=6, prompt_min=4, prompt_max=12, new_tokens=5, concurrency=3)
SERVER = "linnet:reference:numpy"


def test_profiles_are_the_stated_workloads():
    assert PROFILES["seed"].describe() == \
        "256 requests of 128-512 prompt tokens and 128 new tokens, at most 64 in flight"
    assert (PROFILES["cpu-prompt"].requests, PROFILES["cpu-prompt"].new_tokens, PROFILES["cpu-prompt"].concurrency) \
        == (64, 64, 16)
    assert (PROFILES["cpu-decode"].prompt_min, PROFILES["cpu-decode"].prompt_max) == (32, 128)


def test_prompts_are_fixed_and_in_range():
    prompts = random_prompts(331, TINY)
    assert prompts == random_prompts(331, TINY)
    assert len(prompts) == TINY.requests
    assert all(TINY.prompt_min <= len(p) <= TINY.prompt_max and max(p) < 331 for p in prompts)
    assert len({len(p) for p in prompts}) > 1  # lengths vary


def test_the_copying_profiles_send_the_workloads_chat_prompts_in_turn(checkpoint_dir):
    loaded = open_model(str(checkpoint_dir(CASE)))
    wide = replace(PROFILES["cpu-copying"], prompt_max=1000)
    ids = workload_load(loaded.tokenizer, wide)
    texts = [text for _, text in workload_prompts("copying")]
    assert len(ids) == wide.requests == 2 * len(texts) and ids[:len(texts)] == ids[len(texts):]
    assert ids[0] == loaded.tokenizer.encode_chat([{"role": "user", "content": texts[0]}])
    prompts = Prompts.draw(loaded.tokenizer, loaded.spec.vocab_size, wide)
    assert prompts.ids == ids and prompts.follows is None and prompts.warm_up_ids not in ids
    assert (PROFILES["cpu-copying"].concurrency, PROFILES["cpu-copying-1"].concurrency) == (4, 1)
    with pytest.raises(LinnetError, match="a prompt of its workload takes .* tokens .* more than the 256"):
        workload_load(loaded.tokenizer, PROFILES["cpu-copying"])  # this tiny tokenizer's tokens are short
    with pytest.raises(LinnetError, match="a workload is one of"):
        ServingProfile("bad", 4, 1, 8, 4, 1, workload="poems")


def test_a_speculating_row_is_compared_with_the_same_server_without(checkpoint_dir):
    plain, speculating = serving_rows(str(checkpoint_dir(CASE)), [SERVER, SERVER + "+ngram"], TINY, "f32", 1,
                                      io.StringIO())
    assert speculating.not_run is None, speculating.not_run
    assert (speculating.id, speculating.against.row) == ("speculative:serve:reference:numpy", plain.id)
    assert speculating.name.endswith("(speculative, ngram)") and "30 tokens returned (6 x 5)" in speculating.notes
    assert any(n.startswith("speculative decoding by prompt lookup (--speculate ngram") for n in speculating.notes)
    server = make_server(SERVER + "+ngram", "m", None, 1, 16, 1, 1, 1, "f32", 1)
    assert server.command[server.command.index("--speculate") + 1] == "ngram"
    with pytest.raises(NotRunnable, match=r"speculation \(\+ngram\) is measured on linnet:BACKEND and ray"):
        server_ids("vllm+ngram")


def test_the_chat_profile_shares_a_system_prompt():
    chat = PROFILES["cpu-chat"]
    assert chat.describe() == ("64 requests of 1056-1152 prompt tokens (the first 1024 shared by all) and 64 new "
                               "tokens, at most 16 in flight")
    prompts = random_prompts(331, chat)
    assert all(p[:1024] == prompts[0][:1024] and 32 <= len(p) - 1024 <= 128 for p in prompts)
    assert len({tuple(p[1024:1032]) for p in prompts}) == len(prompts)  # the rest is each one's own
    assert random_prompts(331, chat, seed=1)[0][:8] != prompts[0][:8]  # the warm-up's system prompt differs


def conversations_of(follows: list[int | None]) -> list[list[int]]:
    """The load's requests (indices) grouped by conversation, each in its turns' order."""
    chains: list[list[int]] = []
    chain_of: dict[int, list[int]] = {}
    for i, previous in enumerate(follows):
        chain = chain_of[previous] if previous is not None else []
        if previous is None:
            chains.append(chain)
        assert previous is None or chain[-1] == previous  # a turn follows its conversation's latest turn
        chain.append(i)
        chain_of[i] = chain
    return chains


def test_the_turns_profile_is_conversations_that_grow_turn_by_turn():
    turns = PROFILES["cpu-turns"]
    assert turns.describe() == (
        "64 requests in 16 conversations of 4 turns, sent turn by turn: each opens with 512-768 prompt tokens of its "
        "own, and a later turn's prompt is the previous one's and 64-128 more (up to 1152); 64 new tokens, at most "
        "16 in flight")
    assert (turns.positions, turns.serving().prompt_tokens_max) == (1152 + 64, 1152)  # cpu-chat's
    vocab = 49152  # SmolLM2's
    prompts, follows = random_load(vocab, turns)
    assert len(prompts) == len(follows) == 64
    conversations = conversations_of(follows)
    assert len(conversations) == 16 and all(len(c) == 4 for c in conversations)
    for chain in conversations:
        assert 512 <= len(prompts[chain[0]]) <= 768
        for before, after in zip(chain, chain[1:]):  # each turn extends the previous one exactly
            assert prompts[after][:len(prompts[before])] == prompts[before]
            assert 64 <= len(prompts[after]) - len(prompts[before]) <= 128
    assert len({prompts[c[0]][0] for c in conversations}) == 16  # conversations differ from their first token
    # turn-major: requests 16k..16k+15 are every conversation's turn k
    turn_of = {i: k for chain in conversations for k, i in enumerate(chain)}
    assert [turn_of[i] for i in range(64)] == [i // 16 for i in range(64)]
    # shuffled within a turn: the conversations' places (and so their parity) change from turn to turn
    places = [[chain[k] - 16 * k for chain in conversations] for k in range(4)]
    assert all(a != b for a, b in zip(places, places[1:]))
    assert all(any(a % 2 != b % 2 for a, b in zip(x, y)) for x, y in zip(places, places[1:]))
    assert random_load(vocab, turns) == (prompts, follows)  # the same seed, the same load
    assert random_prompts(vocab, turns) == prompts
    other, _ = random_load(vocab, turns, seed=1)  # the warm-up's draw shares no prefix with the load
    assert {p[0] for p in prompts}.isdisjoint({other[0][0]})


def test_a_profile_of_turns_is_whole_conversations_and_keeps_its_turns_when_changed():
    with pytest.raises(LinnetError, match="10 requests are not whole conversations of 4 turns: --requests must be "
                                          "a multiple of 4"):
        ServingProfile("x", 10, 8, 16, 4, 2, turns=4, turn_tokens=(2, 4))
    with pytest.raises(LinnetError, match=r"turn_tokens needs 1 <= least <= most, got \(0, 0\)"):
        ServingProfile("x", 8, 8, 16, 4, 2, turns=4)
    with pytest.raises(LinnetError, match="turns must be at least 1, got 0"):
        ServingProfile("x", 8, 8, 16, 4, 2, turns=0)
    parser = build_parser()
    changed = profile_of(parser.parse_args(["bench-serve", "m", "--profile", "cpu-turns", "--requests", "8",
                                            "--prompt-tokens", "16-32", "--concurrency", "2"]))
    assert (changed.name, changed.turns, changed.turn_tokens, changed.conversations) == \
        ("cpu-turns, changed", 4, (64, 128), 2)
    assert (changed.prompt_min, changed.longest_prompt, changed.concurrency) == (16, 32 + 3 * 128, 2)
    with pytest.raises(LinnetError, match="--requests must be a multiple of 4"):
        profile_of(parser.parse_args(["bench-serve", "m", "--profile", "cpu-turns", "--requests", "6"]))
    assert profile_of(parser.parse_args(["bench-serve", "m", "--profile", "cpu-chat"])) == PROFILES["cpu-chat"]


def test_a_load_of_one_turn_follows_nothing():
    prompts, follows = random_load(331, TINY)
    assert prompts == random_prompts(331, TINY) and follows == [None] * TINY.requests


def test_the_warm_up_shares_no_prefix_with_the_load(checkpoint_dir):
    """A server that caches prefixes (vLLM) must not find a load prompt in its cache from the warm-up."""
    loaded = open_model(str(checkpoint_dir(CASE)))
    tokenizer, vocab = loaded.tokenizer, loaded.spec.vocab_size
    prompts = Prompts.draw(tokenizer, vocab, TINY)
    assert prompts.ids == random_prompts(vocab, TINY)  # the load itself is unchanged
    assert TINY.prompt_min <= len(prompts.warm_up_ids) <= TINY.prompt_max
    assert all(p[:2] != prompts.warm_up_ids[:2] for p in prompts.ids)
    assert prompts.sent(True) == (prompts.warm_up_ids, prompts.ids)
    warm_up_text, texts = prompts.sent(False)
    assert warm_up_text == tokenizer.decode(prompts.warm_up_ids, skip_special_tokens=False)
    assert texts == [tokenizer.decode(p, skip_special_tokens=False) for p in prompts.ids]


def test_the_prompts_of_a_turns_load_carry_what_each_request_follows(checkpoint_dir):
    loaded = open_model(str(checkpoint_dir(CASE)))
    chats = ServingProfile("chats", requests=6, prompt_min=4, prompt_max=8, new_tokens=3, concurrency=3, turns=2,
                           turn_tokens=(2, 4))
    prompts = Prompts.draw(loaded.tokenizer, loaded.spec.vocab_size, chats)
    assert (prompts.ids, prompts.follows) == random_load(loaded.spec.vocab_size, chats)
    assert prompts.follows[:3] == [None] * 3 and sorted(prompts.follows[3:]) == [0, 1, 2]
    assert all(p[:2] != prompts.warm_up_ids[:2] for p in prompts.ids)


def test_linnet_serve_finds_each_conversations_previous_turn_in_its_cache(checkpoint_dir):
    """Through the real server: a turn is sent once its previous turn has been answered, so the row that
    answered it is free again and holds that prompt (the answers are long enough that a conversation's first
    turn is still running when the other's arrives, so neither takes the other's row)."""
    model = str(checkpoint_dir(CASE))
    loaded = open_model(model)
    chats = ServingProfile("chats", requests=6, prompt_min=8, prompt_max=12, new_tokens=20, concurrency=2, turns=3,
                           turn_tokens=(3, 6))
    prompts = Prompts.draw(loaded.tokenizer, loaded.spec.vocab_size, chats)
    run = run_server(SERVER, model, None, chats, "f32", 1, prompts, io.StringIO())
    for timing, prompt, previous in zip(run.load.timings, prompts.ids, prompts.follows):
        assert timing.prompt_tokens == len(prompt)
        if previous is None:
            assert timing.cached_tokens == 0
        else:  # at least the previous turn's prompt (its answer's first tokens may match the new ones by chance)
            assert len(prompts.ids[previous]) <= timing.cached_tokens < len(prompt)


def test_a_token_with_no_text_yet_is_still_its_first_token():
    """vLLM and linnet serve stream a chunk per token, with empty text while it has none to show: the first
    token is that chunk, not the first one with text; a closing chunk with empty text carries no token."""
    def completion(text, finish=None):
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    assert read_chunk(OPENAI, completion("")) == (True, False, None)
    assert read_chunk(OPENAI, completion(" fox")) == (True, False, None)
    assert read_chunk(OPENAI, completion(" end", "length")) == (True, True, None)
    assert read_chunk(OPENAI, completion("", "length")) == (False, True, None)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert read_chunk(OPENAI, {"choices": [], "usage": usage}) == (False, False, usage)
    triton = {"text_output": "", "token_ids": [7], "finish_reason": "", "completion_tokens": 1, "prompt_tokens": 3}
    assert read_chunk(TRITON, triton) == (True, False, None)
    last = triton | {"token_ids": [], "finish_reason": "stop", "completion_tokens": [2]}
    assert read_chunk(TRITON, last) == (False, True, {"completion_tokens": 2, "prompt_tokens": 3})


def test_linnet_serve_rows_validate_and_count_every_token(checkpoint_dir, tmp_path):
    results = serving_results(str(checkpoint_dir(CASE)), "smollm2-135m-instruct", [SERVER], TINY, "f32", 1,
                              io.StringIO())
    save_results(results, tmp_path / "serving.json")  # validates the whole file
    row, = load_results(tmp_path / "serving.json").rows
    assert row.id == "serve:reference:numpy" and row.linnet and row.group == "Serving many requests"
    assert row.not_run is None, row.not_run
    assert f"{TINY.requests * TINY.new_tokens} tokens returned (6 x 5)" in row.notes
    assert len(row.metrics["serve_ttft_ms"].samples) == TINY.requests
    assert set(row.metrics) == {"serve_tok_s", "serve_ttft_ms", "load_s", "peak_mem_gib"}
    assert 0.01 < row.value("peak_mem_gib") < 8
    assert results.machine.matmul_gflop_s.value > 0 and arithmetic.share(row).endswith("%")
    render_site([tmp_path / "serving.json"], tmp_path / "site")
    assert "GFLOP/s, measured in the run" in (tmp_path / "site" / "smollm2-135m-instruct.html").read_text()


def test_rounds_alternate_the_order_and_keep_every_round(checkpoint_dir, tmp_path):
    log = io.StringIO()
    servers = [SERVER, "linnet:torch:eager"]
    results = serving_results(str(checkpoint_dir(CASE)), "smollm2-135m-instruct", servers, TINY, "f32", 1, log,
                              rounds=3)
    started = [line.split(": ", 1)[1] for line in log.getvalue().splitlines() if line.endswith(" of 3) ...")]
    assert started == [f"{SERVER} (round 1 of 3) ...", "linnet:torch:eager (round 1 of 3) ...",
                       "linnet:torch:eager (round 2 of 3) ...", f"{SERVER} (round 2 of 3) ...",
                       f"{SERVER} (round 3 of 3) ...", "linnet:torch:eager (round 3 of 3) ..."]
    assert results.protocol.runs == 3
    for row in results.rows:
        assert row.not_run is None, row.not_run
        tok_s = row.metrics["serve_tok_s"]
        assert len(tok_s.samples) == 3 and tok_s.value == sorted(tok_s.samples)[1]
        assert len(row.metrics["serve_ttft_ms"].samples) == 3 * TINY.requests
        assert len(row.metrics["load_s"].samples) == 3
        assert f"{TINY.requests * TINY.new_tokens} tokens returned (6 x 5)" in row.notes
        rounds, = [note for note in row.notes if note.startswith("3 rounds (the servers' order reversed")]
        assert "time to first token p99 by round: " in rounds
    save_results(results, tmp_path / "serving.json")  # validates
    render_site([tmp_path / "serving.json"], tmp_path / "site")
    assert "median of 3 runs" in (tmp_path / "site" / "smollm2-135m-instruct.html").read_text()


def test_a_server_that_cannot_start_is_a_not_run_row(checkpoint_dir):
    too_long = ServingProfile("too long", requests=2, prompt_min=4, prompt_max=250, new_tokens=50, concurrency=1)
    failed, unknown = serving_rows(str(checkpoint_dir(CASE)), [SERVER, "bogus"], too_long, "f32", 1, io.StringIO())
    assert failed.id == "serve:reference:numpy" and not failed.metrics
    assert failed.not_run.startswith("failed to start (exit 2)") and "--positions 300" in failed.not_run
    assert unknown.not_run == ("unknown server 'bogus' (known: linnet:BACKEND, ray:BACKEND, triton:BACKEND, "
                               "transformers, vllm; +json and +ngram after a linnet or ray one, +round-robin after "
                               "a ray one)")


def test_a_json_schema_row_returns_every_token_and_is_compared_with_the_same_server(checkpoint_dir):
    """The schema cannot be completed within the new tokens, so each answer is a JSON prefix of exactly them."""
    model = str(checkpoint_dir(CASE))
    loaded = open_model(model)
    prompts = Prompts.draw(loaded.tokenizer, loaded.spec.vocab_size, TINY)
    plain, constrained = serving_rows(model, [SERVER, SERVER + "+json"], TINY, "f32", 1, io.StringIO())
    assert constrained.not_run is None, constrained.not_run
    assert constrained.id == "json-schema:serve:reference:numpy" and constrained.name.endswith("(JSON schema)")
    assert "30 tokens returned (6 x 5)" in constrained.notes
    assert constrained.against.row == plain.id == "serve:reference:numpy"
    recomputed, = [n for n in plain.notes if n.startswith("prompt tokens recomputed (not found cached): ")]
    done, sent = re.fullmatch(r".*: (\d+) of (\d+) \(\d+%\)", recomputed).groups()
    assert int(sent) == sum(len(p) for p in prompts.ids) and 0 < int(done) <= int(sent)

    longer = ServingProfile("longer", requests=3, prompt_min=4, prompt_max=12, new_tokens=40, concurrency=3)
    prompts = Prompts.draw(loaded.tokenizer, loaded.spec.vocab_size, longer)  # long enough to open the string
    schema = prompts.response_format["json_schema"]["schema"]
    longest = max(len(t) for t in loaded.tokenizer.hf.get_vocab())
    assert schema["properties"]["text"]["minLength"] > longer.new_tokens * longest
    run = run_server(SERVER + "+json", model, None, longer, "f32", 1, prompts, io.StringIO())
    assert run.server.body["response_format"] == prompts.response_format
    opening = '{"text": "'
    for timing in run.load.timings:
        assert timing.completion_tokens == longer.new_tokens
        assert timing.text.startswith(opening) and len(timing.text) > len(opening), timing.text
        assert '"' not in timing.text[len(opening):].replace('\\"', "")  # the string never closes


def test_json_and_ray_servers_are_refused_by_name_where_they_cannot_run(checkpoint_dir, monkeypatch):
    for spec in ("vllm+json", "transformers+json", "triton:reference:numpy+json"):
        with pytest.raises(NotRunnable, match="JSON-schema load .* linnet:BACKEND and ray:BACKEND servers only"):
            server_ids(spec)
    row_id, name, _ = server_ids("ray:reference:numpy+json", 2)
    assert row_id == "json-schema:ray:serve:reference:numpy"
    assert name.startswith("linnet.serve on Ray Serve (2 replicas), ") and name.endswith(" (JSON schema)")
    if importlib.util.find_spec("ray") is not None:
        with pytest.raises(NotRunnable, match="2 replicas need at least 2 threads"):
            make_server("ray:reference:numpy", "m", None, 1, 16, 1, 1, 1, "f32", 1, replicas=2)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    row, = serving_rows(str(checkpoint_dir(CASE)), ["ray:reference:numpy"], TINY, "f32", 1, io.StringIO())
    assert row.id == "ray:serve:reference:numpy" and row.not_run.startswith("no Ray Serve (ray")
    assert row.not_run.endswith("pip install 'linnet[ray]'")


def test_a_round_robin_ray_server_is_a_row_of_its_own_beside_the_prefix_aware_one():
    row_id, name, linnet = server_ids("ray:reference:numpy+round-robin", 2)
    assert (row_id, linnet) == ("round-robin:ray:serve:reference:numpy", True)
    assert name.startswith("linnet.serve on Ray Serve (2 replicas, round-robin), ")
    assert server_ids("ray:reference:numpy", 2)[0] == "ray:serve:reference:numpy"  # prefix-aware: as before
    both = {server_ids(spec, 2)[0] for spec in ("ray:reference:numpy+round-robin+json",
                                                  "ray:reference:numpy+json+round-robin")}
    assert both == {"json-schema:round-robin:ray:serve:reference:numpy"}
    # each compared in the same run: round-robin with prefix-aware, constrained with unconstrained
    assert same_run_baseline("round-robin:ray:serve:onnx:cpu") == "ray:serve:onnx:cpu"
    assert same_run_baseline("json-schema:round-robin:ray:serve:onnx:cpu") == "round-robin:ray:serve:onnx:cpu"
    for spec, message in (("linnet:reference:numpy+round-robin", "round-robin routing .* ray:BACKEND servers only"),
                          ("vllm+round-robin", "round-robin routing .* ray:BACKEND servers only"),
                          ("ray:reference:numpy+random",
                           r"unknown suffix '\+random' \(known: \+json, \+round-robin, \+ngram\)"),
                          ("ray:reference:numpy+round-robin+round-robin", "a suffix given twice")):
        with pytest.raises(NotRunnable, match=message):
            server_ids(spec)
    if importlib.util.find_spec("ray") is not None:
        robin = make_server("ray:reference:numpy+round-robin", "m", None, 1, 16, 1, 1, 1, "f32", 2, replicas=2)
        prefix = make_server("ray:reference:numpy", "m", None, 1, 16, 1, 1, 1, "f32", 2, replicas=2)
        for server, router, routed in ((robin, "round-robin", "routed in turn (round-robin)"),
                                       (prefix, "prefix", "routed by prompt prefix")):
            flags = " ".join(server.command)
            assert "--replicas 2 --router " + router in flags and "--threads 1" in flags
            assert any(routed in note for note in server.notes), server.notes


@pytest.mark.slow  # Ray takes 10-20 s to start
def test_ray_serve_with_one_replica_is_compared_with_linnet_serve_alone(checkpoint_dir):
    pytest.importorskip("ray.serve")
    plain, ray, robin = serving_rows(str(checkpoint_dir(CASE)),
                                     [SERVER, "ray:reference:numpy", "ray:reference:numpy+round-robin"], TINY,
                                     "f32", 1, io.StringIO())
    assert ray.not_run is None, ray.not_run
    assert ray.id == "ray:serve:reference:numpy" and "(1 replica)" in ray.name
    assert "30 tokens returned (6 x 5)" in ray.notes and "1 replica of 1 thread each" in " ".join(ray.notes)
    assert ray.against.row == plain.id == "serve:reference:numpy"
    assert ray.value("peak_mem_gib") > plain.value("peak_mem_gib")  # Ray's own processes are counted too
    # the round-robin router's row beside it, compared with it; both say what they computed of the prompts
    assert robin.not_run is None, robin.not_run
    assert robin.id == "round-robin:ray:serve:reference:numpy" and "(1 replica, round-robin)" in robin.name
    assert "30 tokens returned (6 x 5)" in robin.notes and "routed in turn" in " ".join(robin.notes)
    assert robin.against.row == ray.id
    for row in (ray, robin):
        recomputed, = [n for n in row.notes if n.startswith("prompt tokens recomputed (not found cached): ")]
        assert re.fullmatch(r".*: \d+ of \d+ \(\d+%\)", recomputed), recomputed


def test_vllms_kv_cache_is_sized_by_the_load(checkpoint_dir):
    path = checkpoint_dir(CASE)
    spec = open_spec(str(path))
    per_position = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4  # f32 keys and values
    assert vllm_kv_cache_bytes(path, 16, 256, "f32") == 256 * 2**20  # a tiny model: the floor
    assert vllm_kv_cache_bytes(path, 64, 2**16, "f32") == 2 * 64 * 2**16 * per_position
    assert vllm_kv_cache_bytes(path, 64, 2**16, "bf16") == 64 * 2**16 * per_position


def test_peers_need_a_hugging_face_directory():
    from linnet.default_model import DEFAULT_MODEL
    row, = serving_rows(DEFAULT_MODEL, ["vllm"], TINY, "f32", 1, io.StringIO())
    assert row.id == "vllm:serve" and row.not_run.startswith("needs a Hugging Face model directory")


def test_command_writes_results(checkpoint_dir, tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "linnet", "bench-serve", str(checkpoint_dir(CASE)),
                           "--model-id", "smollm2-135m-instruct", "--server", SERVER, "--server", "linnet:torch:eager",
                           "--requests", "4", "--prompt-tokens", "4-8", "--new-tokens", "3", "--concurrency", "2",
                           "--threads", "1", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "linnet.serve" in done.stdout and "TTFT p99" in done.stdout and "Arithmetic" in done.stdout
    rows = load_results(out).rows
    assert [r.id for r in rows] == ["serve:reference:numpy", "serve:torch:eager"]
    assert all("12 tokens returned (4 x 3)" in r.notes for r in rows)


@pytest.mark.slow  # transformers serve takes 15-25 s to start
def test_transformers_serve_returns_exactly_the_new_tokens(checkpoint_dir, tmp_path):
    # Every token an EOS in the model's generation config: a request that heeded it would end at its first token.
    model = shutil.copytree(checkpoint_dir(CASE), tmp_path / "model")
    every_token = list(range(open_spec(str(model)).vocab_size))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": every_token}))
    linnet, peer = serving_rows(str(model), [SERVER, "transformers"], TINY, "f32", 1, io.StringIO(), rounds=2)
    assert peer.id == "transformers:serve" and peer.not_run is None, peer.not_run
    assert "30 tokens returned (6 x 5)" in peer.notes and peer.memory_is_setting
    assert linnet.against.row == "transformers:serve"
    mine, theirs = linnet.metrics["serve_tok_s"].samples, peer.metrics["serve_tok_s"].samples
    per_round = ", ".join(f"{a / b:.2f}x" for a, b in zip(mine, theirs))
    assert f"throughput against transformers:serve round by round: {per_round}" in linnet.notes

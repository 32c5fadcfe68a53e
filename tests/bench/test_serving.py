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

import pytest

from linnet.bench import arithmetic
from linnet.bench.serving import (
    PROFILES,
    Prompts,
    ServingProfile,
    random_prompts,
    run_server,
    serving_results,
    serving_rows,
)
from linnet.bench.serving_client import OPENAI, TRITON, read_chunk
from linnet.bench.serving_servers import NotRunnable, make_server, server_ids, vllm_kv_cache_bytes
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


def test_the_chat_profile_shares_a_system_prompt():
    chat = PROFILES["cpu-chat"]
    assert chat.describe() == ("64 requests of 1056-1152 prompt tokens (the first 1024 shared by all) and 64 new "
                               "tokens, at most 16 in flight")
    prompts = random_prompts(331, chat)
    assert all(p[:1024] == prompts[0][:1024] and 32 <= len(p) - 1024 <= 128 for p in prompts)
    assert len({tuple(p[1024:1032]) for p in prompts}) == len(prompts)  # the rest is each one's own
    assert random_prompts(331, chat, seed=1)[0][:8] != prompts[0][:8]  # the warm-up's system prompt differs


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
                               "transformers, vllm; +json after a linnet or ray one)")


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


@pytest.mark.slow  # Ray takes 10-20 s to start
def test_ray_serve_with_one_replica_is_compared_with_linnet_serve_alone(checkpoint_dir):
    pytest.importorskip("ray.serve")
    plain, ray = serving_rows(str(checkpoint_dir(CASE)), [SERVER, "ray:reference:numpy"], TINY, "f32", 1,
                              io.StringIO())
    assert ray.not_run is None, ray.not_run
    assert ray.id == "ray:serve:reference:numpy" and "(1 replica)" in ray.name
    assert "30 tokens returned (6 x 5)" in ray.notes and "1 replica of 1 thread each" in " ".join(ray.notes)
    assert ray.against.row == plain.id == "serve:reference:numpy"
    assert ray.value("peak_mem_gib") > plain.value("peak_mem_gib")  # Ray's own processes are counted too


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

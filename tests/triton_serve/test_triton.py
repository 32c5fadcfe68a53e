"""`linnet triton` writes a model repository that a real tritonserver loads, and that streams, over gRPC and
HTTP generate_stream, the tokens linnet.serve's engine gives alone."""
from __future__ import annotations

import json
import queue
import threading

import numpy as np
import pytest
from triton_server import missing, tritonserver

from linnet.backends import CacheShape, create_runner
from linnet.cli import main
from linnet.model import open_model
from linnet.serve import LENGTH, Engine, Params

CASE = "qwen3-gqa3"
ROWS, POSITIONS = 4, 64
# (prompt ids, new tokens): more requests than rows, so rows are reused while others stream
REQUESTS = [([5, 9, 20, 33, 7], 9), ([11, 40, 2], 6), (list(range(50, 80)), 12), ([101], 5), ([7, 7, 7, 7], 8),
            ([200, 3, 17], 10)]
FOX = "The quick brown fox"


def write_repository(checkpoint_dir, tmp_path, *extra: str):
    out = tmp_path / "repo"
    assert main(["triton", str(checkpoint_dir(CASE)), "-o", str(out), "--rows", str(ROWS), "--positions",
                 str(POSITIONS), *extra]) == 0
    return out


def test_writes_a_python_backend_repository_and_keeps_what_exists(checkpoint_dir, tmp_path, capsys):
    out = write_repository(checkpoint_dir, tmp_path, "--name", "smol")
    config = (out / "smol" / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "decoupled: true" in config and "count: 1" in config
    assert f'string_value: "{checkpoint_dir(CASE)}"' in config and 'key: "rows" value: { string_value: "4" }' in config
    assert "class TritonPythonModel" in (out / "smol" / "1" / "model.py").read_text()
    assert main(["triton", str(checkpoint_dir(CASE)), "-o", str(out)]) == 2  # no --force: left as it was
    assert "pass --force" in capsys.readouterr().err and (out / "smol").exists()


def engine_alone(checkpoint_dir):
    """What linnet.serve's engine gives for REQUESTS (greedy, f32) and for FOX as text."""
    model = open_model(str(checkpoint_dir(CASE)))
    runner = create_runner("torch:eager", model.weights, CacheShape(ROWS, POSITIONS))
    engine = Engine(runner, model.tokenizer).start()
    try:
        tokens = [engine.submit(ids, Params(max_tokens=new, ignore_eos=True)).result() for ids, new in REQUESTS]
        fox = engine.submit(model.tokenizer.encode(FOX), Params(max_tokens=12)).result()
    finally:
        engine.stop()
    return tokens, fox


def grpc_streams(address: str) -> dict[str, list]:
    """Every request of REQUESTS on one gRPC stream at once; each request's responses, in order."""
    import tritonclient.grpc as grpcclient

    responses: dict[str, list] = {str(i): [] for i in range(len(REQUESTS))}
    finished = threading.Semaphore(0)
    errors: queue.Queue = queue.Queue()

    def on_response(result, error) -> None:
        if error is not None:
            errors.put(error)
            finished.release()
            return
        response = result.get_response()
        responses[response.id].append(result)
        if response.parameters["triton_final_response"].bool_param:
            finished.release()

    client = grpcclient.InferenceServerClient(address)
    client.start_stream(callback=on_response)
    try:
        for i, (ids, new) in enumerate(REQUESTS):
            inputs = [tensor(grpcclient, "prompt_ids", np.array(ids, np.int64)),
                      tensor(grpcclient, "max_tokens", np.array([new], np.int32)),
                      tensor(grpcclient, "ignore_eos", np.array([True]))]
            client.async_stream_infer("linnet", inputs, request_id=str(i))
        for _ in REQUESTS:
            assert finished.acquire(timeout=60), "a stream did not finish"
    finally:
        client.stop_stream()
        client.close()
    assert errors.empty(), errors.get()
    return responses


def tensor(module, name: str, values: np.ndarray):
    kind = {"int64": "INT64", "int32": "INT32", "bool": "BOOL"}[values.dtype.name]
    t = module.InferInput(name, list(values.shape), kind)
    t.set_data_from_numpy(values)
    return t


def generate_stream(url: str, body: dict) -> list[dict]:
    """The JSON of each server-sent event from Triton's HTTP generate_stream."""
    import requests

    answer = requests.post(f"http://{url}/v2/models/linnet/generate_stream", json=body, stream=True, timeout=60)
    assert answer.status_code == 200, answer.text
    return [json.loads(line[len("data: "):]) for line in answer.iter_lines(decode_unicode=True)
            if line.startswith("data: ")]


def test_tritonserver_streams_the_engines_tokens(checkpoint_dir, tmp_path):
    reason = missing()
    if reason:
        pytest.skip(reason)
    repository = write_repository(checkpoint_dir, tmp_path)
    alone, fox = engine_alone(checkpoint_dir)
    with tritonserver(repository, tmp_path) as (http, grpc, _):
        streamed = grpc_streams(grpc)
        for i, expected in enumerate(alone):
            results = streamed[str(i)]
            pieces = [r.as_numpy("token_ids").tolist() for r in results]
            assert [t for piece in pieces for t in piece] == expected.token_ids
            assert all(len(piece) == 1 for piece in pieces)  # one response per generated token
            last = results[-1]
            assert last.as_numpy("finish_reason")[0] == LENGTH.encode()
            assert last.as_numpy("completion_tokens")[0] == len(expected.token_ids)
            assert b"".join(r.as_numpy("text_output")[0] for r in results).decode() == expected.text

        events = generate_stream(http, {"text_input": FOX, "max_tokens": 12})
        assert "".join(e["text_output"] for e in events) == fox.text
        assert [t for e in events for t in np.atleast_1d(e["token_ids"]).tolist()] == fox.token_ids
        assert events[-1]["finish_reason"] == fox.finish_reason

        import requests  # a bad request is refused by name, and the server serves the next one
        refused = requests.post(f"http://{http}/v2/models/linnet/generate", json={"max_tokens": 4}, timeout=30)
        assert refused.status_code >= 400 and "text_input or as prompt_ids" in refused.text
        whole = requests.post(f"http://{http}/v2/models/linnet/generate",
                              json={"text_input": FOX, "max_tokens": 12, "stream": False}, timeout=30)
        assert whole.status_code == 200 and whole.json()["text_output"] == fox.text

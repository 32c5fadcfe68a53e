"""Cancelling through Triton frees the engine's rows: gRPC streams cancelled mid-generation
(`stop_stream(cancel_requests=True)`) leave every row free, long before the generations could have ended,
and new requests then run to completion in them. Rows busy and tokens generated are read from the linnet_*
metrics the repository's model reports on Triton's /metrics."""
from __future__ import annotations

import threading
import time
import urllib.request
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from checkpoints import CASES_BY_ID, build_checkpoint
from triton_server import missing, tritonserver

from linnet.cli import main

ROWS, POSITIONS = 2, 2048
LONG, SHORT = 2000, 8  # new tokens: the cancelled generations', and the requests' that follow
STARTED_AFTER = 3  # responses each long generation has sent when the stream is cancelled


def tensor(name: str, values: np.ndarray):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(values.shape), {"int64": "INT64", "int32": "INT32", "bool": "BOOL"}[
        values.dtype.name])
    t.set_data_from_numpy(values)
    return t


def request(prompt: list[int], new_tokens: int) -> list:
    return [tensor("prompt_ids", np.array(prompt, np.int64)), tensor("max_tokens", np.array([new_tokens], np.int32)),
            tensor("ignore_eos", np.array([True]))]


def metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not among Triton's metrics")


def wait_for_free_rows(address: str, timeout: float) -> float:
    """Seconds until the engine reports no row busy."""
    start = time.monotonic()
    while metric(address, "linnet_rows_busy") != 0:
        assert time.monotonic() - start < timeout, f"rows still busy after {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.slow  # builds a checkpoint with a long context and starts tritonserver: about 20 s
def test_cancelled_streams_free_their_rows(tmp_path):
    reason = missing()
    if reason:
        pytest.skip(reason)
    import tritonclient.grpc as grpcclient

    long_context = replace(CASES_BY_ID["qwen3-gqa3"], config={**CASES_BY_ID["qwen3-gqa3"].config,
                                                              "max_position_embeddings": POSITIONS})
    checkpoint = build_checkpoint(long_context, tmp_path / "checkpoint")
    repository = tmp_path / "repo"
    assert main(["triton", str(checkpoint), "-o", str(repository), "--backend", "torch:eager", "--rows", str(ROWS),
                 "--positions", str(POSITIONS)]) == 0
    with tritonserver(repository, tmp_path) as (_, grpc, metrics):
        client = grpcclient.InferenceServerClient(grpc)
        responses: Counter[str] = Counter()
        started = threading.Semaphore(0)

        def on_response(result, error) -> None:
            if error is None:
                rid = result.get_response().id
                responses[rid] += 1
                if responses[rid] == STARTED_AFTER:
                    started.release()

        client.start_stream(callback=on_response)
        for i in range(ROWS):
            client.async_stream_infer("linnet", request([5 + i, 9, 20], LONG), request_id=str(i))
        for _ in range(ROWS):
            assert started.acquire(timeout=60), "a long generation did not start"
        client.stop_stream(cancel_requests=True)

        wait_for_free_rows(metrics, timeout=30)
        generated = metric(metrics, "linnet_generated_tokens_total")
        assert generated < ROWS * LONG / 2, f"{generated} tokens generated: the rows ran on after the cancel"

        finished = threading.Semaphore(0)
        tokens: Counter[str] = Counter()
        reasons: dict[str, str] = {}

        def on_short(result, error) -> None:
            if error is not None:
                reasons[str(error)] = "error"
                finished.release()
                return
            rid = result.get_response().id
            tokens[rid] += len(result.as_numpy("token_ids"))
            if result.get_response().parameters["triton_final_response"].bool_param:
                reasons[rid] = result.as_numpy("finish_reason")[0].decode()
                finished.release()

        client.start_stream(callback=on_short)
        try:
            for i in range(ROWS):
                client.async_stream_infer("linnet", request([40 + i, 7], SHORT), request_id=f"new{i}")
            for _ in range(ROWS):
                assert finished.acquire(timeout=30), "a request after the cancel did not finish"
        finally:
            client.stop_stream()
            client.close()
        assert reasons == {f"new{i}": "length" for i in range(ROWS)}
        assert tokens == {f"new{i}": SHORT for i in range(ROWS)}
        wait_for_free_rows(metrics, timeout=10)

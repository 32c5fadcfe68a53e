"""A Triton Python-backend model serving a Linnet model through linnet.serve's engine.

Written by `linnet triton` as REPO/NAME/1/model.py; it runs inside Triton's Python-backend stub, whose
Python must import linnet. The repository's config.pbtxt holds the settings (model, backend, dtype, rows,
positions, max_queue, threads). One engine thread owns the model and batches every request in its cache
rows; `execute` only submits, and a sender thread turns the engine's events into Triton responses, so
neither waits on the other. Decoupled: one response per generated piece, the last with the final flag.
The engine's rows busy, queue length and generated tokens appear on Triton's /metrics as linnet_* metrics.
"""
import json
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from linnet.backends import CacheShape, create_runner
from linnet.backends.registry import get_backend
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.sampling import Sampling
from linnet.serve import CANCELLED, ERROR, Engine, Params
from linnet.serve.engine import STEP_PROMPT_TOKENS
from linnet.serve.model_thread import ModelThread

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_PERIOD_S = 0.25  # how often the engine's counts are copied into Triton's metrics


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        settings = {key: value["string_value"] for key, value in config["parameters"].items()}
        backend, threads = settings["backend"], int(settings["threads"])
        if threads:
            get_backend(backend).package.set_threads(threads)
        model = open_model(settings["model"])
        shape = CacheShape(int(settings["rows"]), int(settings["positions"]))
        thread = ModelThread()  # the runner is built, warmed up and stepped on one thread
        runner = thread.run(create_runner, backend, model.weights, shape, dtype=settings["dtype"])
        self.tokenizer = model.tokenizer
        step_tokens = int(settings.get("prefill_tokens", STEP_PROMPT_TOKENS))  # repositories written before it
        self.engine = Engine(runner, model.tokenizer, max_queue=int(settings["max_queue"]), prefill_tokens=step_tokens,
                             thread=thread)
        self.engine.warm_up()  # a compiled backend compiles now, not in the first request
        self.engine.start()
        self.outbox = queue.Queue()  # (Reply, Event) from the engine thread, None to stop
        self.sender = threading.Thread(target=self._send, name="linnet-triton-sender", daemon=True)
        self.sender.start()
        self.engine_metrics = EngineMetrics(args["model_name"])
        self.stopping = threading.Event()
        self.reporter = threading.Thread(target=self._report, name="linnet-triton-metrics", daemon=True)
        self.reporter.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt, params, stream = self._read(request)
                reply = Reply(sender, stream)
                reply.handle = self.engine.submit(prompt, params, on_event=lambda e, r=reply: self.outbox.put((r, e)))
            except (LinnetError, UnicodeDecodeError) as e:  # the request's fault: refuse it, serve the rest
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
        return None  # decoupled: the responses go through each request's sender

    def finalize(self):
        self.engine.stop()  # ends every request still running or waiting
        self.outbox.put(None)
        self.sender.join()
        self.stopping.set()
        self.reporter.join()
        self.engine_metrics.close()

    def _send(self):
        while (item := self.outbox.get()) is not None:
            reply, event = item
            reply.take(event)

    def _report(self):
        while not self.stopping.wait(METRICS_PERIOD_S):
            self.engine_metrics.update(self.engine)

    def _read(self, request):
        """The prompt's ids, the request's Params and whether it streams, from its input tensors."""
        def values(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy().reshape(-1)

        def scalar(name, kind, default):
            found = values(name)
            if found is None:
                return default
            if found.size != 1:
                raise LinnetError(f"{name} must hold one value, got {found.size}")
            return kind(found[0])

        text, ids = values("text_input"), values("prompt_ids")
        if (text is None) == (ids is None):
            raise LinnetError("give the prompt as text_input or as prompt_ids, one of the two")
        if text is not None:
            if self.tokenizer is None:
                raise LinnetError("this model has no tokenizer: give prompt_ids")
            prompt = self.tokenizer.encode(scalar("text_input", bytes.decode, None))
        else:
            prompt = ids.tolist()
        sampling = Sampling(scalar("temperature", float, 0.0), scalar("top_k", int, 0), scalar("top_p", float, 1.0),
                            scalar("seed", int, None))
        stop, stop_ids = values("stop"), values("stop_token_ids")
        params = Params(max_tokens=scalar("max_tokens", int, 16), sampling=sampling,
                        stop=tuple(s.decode() for s in stop if s) if stop is not None else (),
                        stop_ids=tuple(stop_ids.tolist()) if stop_ids is not None else (),
                        ignore_eos=scalar("ignore_eos", bool, False))
        return prompt, params, scalar("stream", bool, True)


class EngineMetrics:
    """The engine's counts as Triton metrics, labelled with the model's name."""

    def __init__(self, model_name):
        def metric(name, kind, description):
            family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self.families.append(family)
            return family.Metric(labels={"model": model_name})

        self.families = []  # each must outlive its metric (close)
        self.rows_busy = metric("linnet_rows_busy", pb_utils.MetricFamily.GAUGE, "cache rows serving a request")
        self.queue_length = metric("linnet_queue_length", pb_utils.MetricFamily.GAUGE, "requests waiting for a row")
        self.generated = metric("linnet_generated_tokens_total", pb_utils.MetricFamily.COUNTER,
                                "tokens generated, cancelled requests' included")
        self.counted = 0

    def update(self, engine):
        self.rows_busy.set(engine.rows_busy)
        self.queue_length.set(engine.queue_length)
        generated = engine.metrics.generated_tokens
        self.generated.increment(generated - self.counted)
        self.counted = generated

    def close(self):
        del self.rows_busy, self.queue_length, self.generated
        self.families.clear()


class Reply:
    """One request's way back: each event as a response (or, not streaming, all of them as one)."""

    def __init__(self, sender, stream):
        self.sender, self.stream = sender, stream
        self.handle = None  # the engine's Request, once submitted
        self.text, self.tokens = [], []

    def take(self, event):
        if self.sender.is_cancelled():  # the client went away: free the row; Triton still needs the final flag
            if self.handle is not None:
                self.handle.cancel()
            if event.finish_reason:
                self.sender.send(flags=FINAL)
            return
        if event.finish_reason in (ERROR, CANCELLED):  # a failed step, or the engine stopping
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(event.error or "cancelled")),
                             flags=FINAL)
            return
        if self.stream:
            self.sender.send(response(event.text, event.token_ids, event), flags=FINAL if event.finish_reason else 0)
            return
        self.text.append(event.text)
        self.tokens += event.token_ids
        if event.finish_reason:
            self.sender.send(response("".join(self.text), self.tokens, event), flags=FINAL)


def response(text, token_ids, event):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
        pb_utils.Tensor("token_ids", np.array(token_ids, dtype=np.int64)),
        pb_utils.Tensor("finish_reason", np.array([(event.finish_reason or "").encode()], dtype=np.object_)),
        pb_utils.Tensor("prompt_tokens", np.array([event.prompt_tokens], dtype=np.int32)),
        pb_utils.Tensor("completion_tokens", np.array([event.completion_tokens], dtype=np.int32)),
    ])

"""vLLM as a one-request bench subject: a worker run by the Python in ``$LINNET_VLLM_PYTHON``.

vLLM's CPU build pins its own torch, so it cannot share a process (or a virtual environment) with Linnet.
This file is therefore a standalone script -- the standard library, NumPy and vLLM, nothing of Linnet --
run by path (``python -P .../peers_vllm.py ...``, the parent is ``linnet.bench.vllm_rows``), and it speaks
``linnet.bench.worker``'s line protocol: one JSON line once loaded, one per ``run``, one at ``done``.

The protocol is the bench's: the job's prompt as token ids, greedy, exactly ``new_tokens`` tokens
(``ignore_eos``). Times come from vLLM's engine one step at a time (``LLMEngine.step``, which returns the
request's tokens so far after every step): time to first token is from ``add_request`` to the step that
returns the first token, decode from there to the step that returns the last one. The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the peak memory is this process's.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from typing import Any

# Before vLLM is imported: its engine in this process, not in a child one.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

USAGE = "peers_vllm.py JOB MODEL_DIR LOGITS_PATH RECORD_STEPS KV_CACHE_BYTES [--load-only]"
HF_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def reply(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


class VllmSubject:
    def __init__(self, job: dict[str, Any], model_dir: str, kv_cache_bytes: int):
        import vllm  # untimed, as every subject's imports
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.vllm, self.TokensPrompt, self.Kind = vllm, TokensPrompt, RequestOutputKind
        self.job, self.model_dir, self.kv_cache_bytes = job, model_dir, kv_cache_bytes
        self.requests = 0

    def load(self) -> None:
        p = self.job["protocol"]
        self.llm = self.vllm.LLM(
            model=self.model_dir, dtype=HF_DTYPES[self.job["dtype"]],
            max_model_len=p["prompt_tokens"] + p["new_tokens"], max_num_seqs=1,
            kv_cache_memory_bytes=self.kv_cache_bytes,
            # Every run prefills the whole prompt: vLLM would otherwise find the repeated prompt in its cache.
            enable_prefix_caching=False,
            skip_tokenizer_init=True,  # token ids in and out, as every subject of the bench
            logprobs_mode="raw_logits", max_logprobs=-1,  # the first run's logits, for the distance
            disable_log_stats=True,
        )
        self.engine = self.llm.llm_engine
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()

    def generate(self, new_tokens: int, record: int) -> tuple[float, float, list[int], list[list[float]]]:
        """Time to first token, first to last token, the tokens, and the first ``record`` steps' logits."""
        params = self.vllm.SamplingParams(
            temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False,
            logprobs=-1 if record else None, output_kind=self.Kind.CUMULATIVE)
        self.requests += 1
        times: list[float] = []
        output = None
        start = time.perf_counter()
        self.engine.add_request(str(self.requests), self.TokensPrompt(prompt_token_ids=self.job["prompt"]), params)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                now = time.perf_counter()
                output = out.outputs[0]
                times += [now] * (len(output.token_ids) - len(times))
        if output is None or not times:
            raise RuntimeError("vLLM finished the request without a token")
        logits = [self._row(step) for step in (output.logprobs or [])[:record]]
        return times[0] - start, times[-1] - times[0], list(output.token_ids), logits

    def _row(self, step: Any) -> list[float]:
        """One step's raw logits over the whole vocabulary (logprobs_mode raw_logits, every token asked for)."""
        row = [float("-inf")] * self.vocab
        for token, logprob in step.items():
            if token < self.vocab:
                row[token] = logprob.logprob
        return row

    def notes(self) -> list[str]:
        return [
            f"vLLM {self.vllm.__version__} (CPU build), in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), "
            "one sequence at a time",
            f"KV cache {self.kv_cache_bytes / 2**20:.0f} MiB (kv_cache_memory_bytes), prefix caching off",
            "compiled as vLLM's CPU build compiles by default (torch.compile, inductor)",
            "time to first token: add_request to the engine step that returns the first token; "
            "decode: from that step to the one that returns the last (LLMEngine.step)",
            "prompt as token ids; no tokenizer, no detokenizing",
        ]


def failure(e: BaseException) -> dict[str, str]:
    """A row "not run" with the reason; unexpected errors keep their traceback (on stderr: the parent's log)."""
    if isinstance(e, ModuleNotFoundError) and e.name == "vllm":
        return {"not_run": f"vLLM is not installed for {sys.executable} ($LINNET_VLLM_PYTHON)"}
    traceback.print_exc()
    return {"not_run": f"failed: {type(e).__name__}: {e}"}


def generation(subject: VllmSubject, logits_path: str, record: int) -> dict[str, Any]:
    """One run, as linnet.bench.worker reports it; ``record`` > 0 (the first run) also saves its logits."""
    import numpy as np

    p = subject.job["protocol"]
    started = time.time()  # wall clock: when this run happened, for the parent's record
    ttft_s, decode_s, tokens, logits = subject.generate(p["new_tokens"], record)
    if len(tokens) != p["new_tokens"]:
        raise RuntimeError(f"vLLM generated {len(tokens)} tokens, not the {p['new_tokens']} asked for")
    sample: dict[str, Any] = {"started": started, "ttft_s": ttft_s, "decode_tok_s": (len(tokens) - 1) / decode_s}
    if record:
        np.save(logits_path, np.array(logits, dtype=np.float32))
        sample.update(first_generation_s=ttft_s + decode_s, tokens=tokens[: len(logits)])
        # Untimed, in this warm-up: a request without logprobs takes other paths, which compile on first use;
        # the first timed run would otherwise pay for them.
        subject.generate(p["new_tokens"], record=0)
    return sample


def main(argv: list[str]) -> int:
    if len(argv) not in (5, 6) or argv[5:] not in ([], ["--load-only"]):
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    job_path, model_dir, logits_path, record_steps, kv_cache_bytes = argv[:5]
    header: dict[str, Any] = {"accelerator": None}
    try:
        with open(job_path) as f:
            job = json.load(f)
        subject = VllmSubject(job, model_dir, int(kv_cache_bytes))
        start = time.perf_counter()
        subject.load()
        import torch  # vLLM's own, already imported by it

        reply({**header, "threads": torch.get_num_threads(), "load_s": time.perf_counter() - start})
    except Exception as e:
        reply({**header, **failure(e)})
        return 0
    if argv[5:]:
        return 0
    runs = 0
    for line in sys.stdin:
        if line.strip() != "run":
            break
        try:
            reply(generation(subject, logits_path, int(record_steps) if runs == 0 else 0))
        except Exception as e:
            reply(failure(e))
            return 0
        runs += 1
    reply({"peak_memory": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "notes": subject.notes()})
    os._exit(0)  # vLLM's teardown adds nothing the row needs, and the parent waits for this process to end


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

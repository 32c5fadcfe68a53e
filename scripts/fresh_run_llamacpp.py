"""llama.cpp in a fresh process, timed as `linnet run` reports itself, for a side-by-side of the two.

    python scripts/fresh_run_llamacpp.py [--chat "..."] [--max-new-tokens 128] [--threads 2]

Runs the default model's GGUF file through llama-cpp-python on the same chat prompt ids `linnet run
--chat` builds, greedy, and prints one line: load, first token, decode tokens/s over the tokens after
the first, and the process's wall time. Alternate it with `linnet run --chat ...` to compare (README,
"llama.cpp's blocks").
"""
from __future__ import annotations

import argparse
import time

START = time.perf_counter()

import llama_cpp  # noqa: E402

from linnet.default_model import DEFAULT_MODEL  # noqa: E402
from linnet.model import open_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chat", default="Write a short poem about the sea.")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = open_model(DEFAULT_MODEL)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": args.chat}])
    loading = time.perf_counter()
    llm = llama_cpp.Llama(str(model.path), n_ctx=len(prompt) + args.max_new_tokens + 8, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    loaded = time.perf_counter()
    count, first = 0, None
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        count += 1
        first = first or time.perf_counter()
        if count == args.max_new_tokens:
            break
    end = time.perf_counter()
    print(f"llama.cpp: load {loaded - loading:.2f} s, first token {(first - loaded) * 1000:.0f} ms, "
          f"decode {(count - 1) / (end - first):.1f} tok/s, {args.threads} threads, wall {end - START:.2f} s")


if __name__ == "__main__":
    main()

"""llama.cpp's prompt-lookup decoding as ``linnet bench --speculate``'s peer, on tiny GGUF files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from linnet.backends import CacheShape, create_runner
from linnet.bench.peers_llamacpp_lookup import LlamaCppLookup
from linnet.cli import main
from linnet.errors import LinnetError
from linnet.generation import generate
from linnet.gguf.export import export_gguf
from linnet.model import open_model

pytestmark = pytest.mark.llamacpp


def test_lookup_drafts_and_keeps_llama_cpps_greedy_tokens(checkpoint_dir, tmp_path: Path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    model = open_model(str(checkpoint_dir("qwen2-tied")))
    path = export_gguf(model, tmp_path / "m.gguf", "f32")
    peer = LlamaCppLookup(path, threads=1, positions=64, draft_tokens=4, ngram=2)
    proposed: list[int] = []
    drafter = peer.lookup.draft_model
    peer.lookup.draft_model = lambda ids, **kw: (lambda d: proposed.append(len(d)) or d)(drafter(ids, **kw))
    prompt = [5, 6, 7, 8, 9] * 4  # a pattern to copy
    plain = peer.generate(prompt, 16, eos_ids=(), lookup=False)
    fast = peer.generate(prompt, 16, eos_ids=(), lookup=True)
    runner = create_runner("reference:numpy", model.weights, CacheShape(1, 64), "f32")
    assert plain.token_ids == generate(runner, prompt, 16, eos_ids=()).token_ids  # llama.cpp's greedy is Linnet's
    assert fast.token_ids == plain.token_ids and len(plain.token_ids) == 16
    assert sum(proposed) > 0  # the drafter proposed, and llama.cpp checked, drafts
    assert plain.decode_tok_s > 0 and fast.decode_tok_s > 0
    t = plain.token_ids
    first_new = next(i for i in range(1, len(t)) if t[i] not in t[:i])
    ended = peer.generate(prompt, 16, eos_ids=(t[first_new],), lookup=True)  # counted as Linnet counts
    assert ended.token_ids == t[:first_new]


def test_bench_speculate_runs_llama_cpps_lookup_beside(checkpoint_dir, capsys, tmp_path: Path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    out = tmp_path / "spec.json"
    assert main(["bench", str(checkpoint_dir("qwen3-gqa3")), "--backend", "torch:eager", "--speculate", "ngram",
                 "--peer", "llama.cpp", "--workload", "chat", "--new-tokens", "8", "--runs", "1",
                 "--threads", "1", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["peer"].startswith("llama.cpp (llama-cpp-python ")
    for row in result["rows"]:
        assert row["llamacpp_plain_tok_s"] > 0 and row["llamacpp_lookup_tok_s"] > 0
        assert row["ratio_to_llamacpp_lookup"] == pytest.approx(
            row["speculative_tok_s"] / row["llamacpp_lookup_tok_s"], abs=1e-3)
        assert isinstance(row["llamacpp_same_tokens"], bool)
    printed = capsys.readouterr().out
    assert "spec/lookup" in printed and "beside llama.cpp" in printed and "its GGUF export" in printed


def test_a_file_llama_cpp_does_not_load_is_refused_by_name(tmp_path: Path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(LinnetError, match="llama.cpp did not load .*bad.gguf"):
        LlamaCppLookup(bad, threads=1, positions=64, draft_tokens=4, ngram=2)

"""``linnet run --speculate`` and ``linnet bench --speculate`` on a tiny model."""
from __future__ import annotations

import json

import pytest

from linnet.cli import main

PROMPT = "The quick brown fox. The quick brown fox. The quick"


def run_json(capsys, *args: str) -> dict:
    assert main(["run", *args, "--prompt", PROMPT, "--max-new-tokens", "24", "--backend", "torch:eager",
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_run_speculating_reports_drafts_and_keeps_the_tokens(checkpoint_dir, capsys, draft):
    model = str(checkpoint_dir("qwen3-gqa3"))
    plain = run_json(capsys, model)
    out = run_json(capsys, model, "--speculate", "ngram" if draft == "ngram" else model, "--draft-tokens", "4")
    assert out["token_ids"] == plain["token_ids"] and "speculation" not in plain
    report = out["speculation"]
    assert report["drafter"] == ("ngram" if draft == "ngram" else "draft") and report["draft_tokens"] == 4
    assert 0 < report["accepted"] <= report["drafted"]


def test_run_refuses_too_many_draft_tokens(checkpoint_dir, capsys):
    assert main(["run", str(checkpoint_dir("qwen3-gqa3")), "--prompt", "Hi", "--speculate", "ngram",
                 "--draft-tokens", "4096", "--backend", "torch:eager"]) != 0
    assert "--draft-tokens must be 1 to" in capsys.readouterr().err


@pytest.mark.parametrize("command, flags, message", [
    ("run", ["--draft-tokens", "4"], "--draft-tokens only applies with --speculate"),
    ("bench", ["--ngram", "2", "--draft-tokens", "4"], "--draft-tokens and --ngram only apply with --speculate"),
    ("run", ["--speculate", "MODEL", "--ngram", "2"], "--ngram applies to --speculate ngram"),
    ("bench", ["--speculate", "ngram", "--peer", "transformers"], "llama.cpp's prompt lookup (--peer llama.cpp), "
                                                                 "not transformers"),
    ("bench", ["--speculate", "MODEL", "--peer", "llama.cpp"], "--peer llama.cpp compares prompt lookup"),
])
def test_speculation_flags_without_their_mode_are_refused(checkpoint_dir, capsys, command, flags, message):
    model = str(checkpoint_dir("qwen3-gqa3"))
    flags = [model if f == "MODEL" else f for f in flags]
    prompt = ["--prompt", "Hi"] if command == "run" else []
    assert main([command, model, *prompt, *flags, "--backend", "torch:eager"]) != 0
    assert message in capsys.readouterr().err


def test_bench_speculate_prints_a_row_per_prompt(checkpoint_dir, capsys, tmp_path):
    out = tmp_path / "spec.json"
    assert main(["bench", str(checkpoint_dir("qwen3-gqa3")), "--backend", "torch:eager", "--speculate", "ngram",
                 "--workload", "chat", "--new-tokens", "8", "--runs", "1", "-o", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["chat", "chat"]
    assert all(r["same_tokens"] and r["drafted"] >= r["accepted"] for r in rows)
    assert "chat" in capsys.readouterr().out

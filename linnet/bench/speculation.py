"""``linnet bench --speculate``: one Linnet backend's decode with and without speculative decoding on the
workload prompts (``linnet.bench.workloads``), in one process, the two taking turns a generation each.

Each prompt is a row: the median decode speed of each over ``runs`` generations (after one untimed
each), their ratio, the drafts' acceptance, and whether the tokens were the same (greedy: they must
be, up to the backend's own difference between its prompt and decode arithmetic; docs/SPECULATIVE.md).
With a llama.cpp ``peer``, its plain and prompt-lookup decoding of the same GGUF file take their turns
too, and each row gains their speeds and Linnet's speculative decode against llama.cpp's.
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from linnet.backends.runner import Runner
from linnet.bench.peers_llamacpp_lookup import LlamaCppLookup
from linnet.bench.workloads import chat_ids, workload_prompts
from linnet.generation import generate
from linnet.speculative import Speculator
from linnet.tokenizer import Tokenizer


@dataclass(frozen=True)
class SpeculationRow:
    kind: str
    prompt_tokens: int
    new_tokens: int
    plain_tok_s: float
    speculative_tok_s: float
    drafted: int
    accepted: int
    same_tokens: bool
    llamacpp_plain_tok_s: float | None = None
    llamacpp_lookup_tok_s: float | None = None
    llamacpp_same_tokens: bool | None = None  # llama.cpp's lookup against its own plain decode

    @property
    def ratio(self) -> float:
        return self.speculative_tok_s / self.plain_tok_s if self.plain_tok_s else 0.0

    @property
    def ratio_to_llamacpp_lookup(self) -> float | None:
        if not self.llamacpp_lookup_tok_s:
            return None
        return self.speculative_tok_s / self.llamacpp_lookup_tok_s

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_json(self) -> dict[str, object]:
        ratio = self.ratio_to_llamacpp_lookup
        return {**asdict(self), "ratio": round(self.ratio, 3), "acceptance": round(self.acceptance, 3),
                **({"ratio_to_llamacpp_lookup": round(ratio, 3)} if ratio is not None else {})}


def run_speculation_bench(runner: Runner, tokenizer: Tokenizer, speculator: Callable[[], Speculator],
                          workload: str, new_tokens: int, runs: int,
                          peer: LlamaCppLookup | None = None) -> list[SpeculationRow]:
    rows = []
    for kind, prompt in workload_prompts(workload):
        ids = chat_ids(tokenizer, prompt)
        plain, fast, drafted, accepted, same = [], [], 0, 0, True
        peer_plain: list[float] = []
        peer_lookup: list[float] = []
        peer_same = True
        for run in range(runs + 1):  # the first of each pays any warming up, untimed
            a = generate(runner, ids, new_tokens, tokenizer=tokenizer)
            spec = speculator()
            b = generate(runner, ids, new_tokens, tokenizer=tokenizer, speculator=spec)
            same = same and a.token_ids == b.token_ids
            if peer is not None:
                c = peer.generate(ids, new_tokens, tokenizer.eos_ids, lookup=False)
                d = peer.generate(ids, new_tokens, tokenizer.eos_ids, lookup=True)
                peer_same = peer_same and c.token_ids == d.token_ids
            if run:
                plain.append(a.decode_tok_s)
                fast.append(b.decode_tok_s)
                drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
                if peer is not None:
                    peer_plain.append(c.decode_tok_s)
                    peer_lookup.append(d.decode_tok_s)
        row = SpeculationRow(kind, len(ids), len(b.token_ids), statistics.median(plain), statistics.median(fast),
                             drafted, accepted, same)
        if peer is not None:
            row = replace(row, llamacpp_plain_tok_s=statistics.median(peer_plain),
                          llamacpp_lookup_tok_s=statistics.median(peer_lookup), llamacpp_same_tokens=peer_same)
        rows.append(row)
    return rows


def format_rows(rows: list[SpeculationRow], described: str) -> str:
    peer = any(r.llamacpp_lookup_tok_s is not None for r in rows)
    lines = [described, f"load average {os.getloadavg()[0]:.2f} after", "",
             f"{'kind':<9} {'prompt':>6} {'new':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
             f"{'accepted':>13} {'same':>5}" + (f" {'llama.cpp':>9} {'lookup':>7} {'same':>5} {'spec/lookup':>11}"
                                                 if peer else "")]
    for r in rows:
        line = (f"{r.kind:<9} {r.prompt_tokens:>6} {r.new_tokens:>4} {r.plain_tok_s:>11.1f} "
                f"{r.speculative_tok_s:>10.1f} {r.ratio:>5.2f}x {r.accepted:>5}/{r.drafted:<5} "
                f"{r.acceptance:>4.0%} {_yes(r.same_tokens):>4}")
        if r.llamacpp_lookup_tok_s is not None:
            line += (f" {r.llamacpp_plain_tok_s:>9.1f} {r.llamacpp_lookup_tok_s:>7.1f} "
                     f"{_yes(bool(r.llamacpp_same_tokens)):>5} {r.ratio_to_llamacpp_lookup:>10.2f}x")
        lines.append(line)
    return "\n".join(lines)


def _yes(same: bool) -> str:
    return "yes" if same else "NO"

"""The "Linnet against the stack it replaces" cards: each side in its fastest configuration.

A card names its two sides by group and a pattern over row ids (never display names, which may be
reworded); each side is the best row that matches. A card whose side did not run is left off.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from linnet.results import METRICS, Results, Row
from linnet.site import format as fmt

# An export is the same model in the same engine, so a small change is noise, not a result.
SAME_SPEED = 0.05


@dataclass(frozen=True)
class Side:
    group: str | None  # None: any group
    ids: str = "*"  # fnmatch pattern over row ids, less their weight form ("llama.cpp" for llama.cpp@f32)
    linnet: bool = False  # only Linnet's own rows, whatever their ids: a new backend joins by itself


@dataclass(frozen=True)
class Spec:
    title: str
    metric: str
    ours: Side
    theirs: Side
    export: bool = False  # shown as a change in percent, as the table shows exports


LLM, ONNX, SERVING = "LLM engines", "ONNX Runtime and TensorRT", "Serving many requests"
# The seed pages' cards, then those of the peers a CPU run has instead (llama.cpp, onnxruntime-genai, the
# HTTP servers); a run has only the cards whose both sides it measured.
SPECS = (
    Spec("vs vLLM, one request", "decode_tok_s", Side(None, linnet=True), Side(LLM, "vllm")),
    Spec("vs llama.cpp, one request", "decode_tok_s", Side(None, linnet=True), Side(LLM, "llama.cpp")),
    Spec("vs the reference, in PyTorch", "decode_tok_s",
         Side("PyTorch", linnet=True), Side("PyTorch", "transformers*")),
    Spec("vs KerasHub, in JAX", "decode_tok_s", Side("JAX", linnet=True), Side("JAX", "keras-hub*")),
    Spec("vs onnxruntime-genai, in ONNX Runtime", "decode_tok_s",
         Side(ONNX, linnet=True), Side(ONNX, "onnxruntime-genai")),
    Spec("exported to vLLM, SGLang, TGI", "decode_tok_s",
         Side(LLM, "vllm:linnet-export"), Side(LLM, "vllm"), export=True),
    Spec("vs vLLM, serving", "serve_tok_s", Side(SERVING, "serve:*"), Side(SERVING, "vllm:batched")),
    Spec("vs vLLM serve, over HTTP", "serve_tok_s", Side(SERVING, "serve:*"), Side(SERVING, "vllm:serve")),
    Spec("vs transformers serve, over HTTP", "serve_tok_s",
         Side(SERVING, "serve:*"), Side(SERVING, "transformers:serve")),
    Spec("exported, serving", "serve_tok_s",
         Side(SERVING, "vllm:batched:linnet-export"), Side(SERVING, "vllm:batched"), export=True),
    Spec("vs vLLM, behind Triton", "serve_tok_s", Side(SERVING, "triton:linnet*"), Side(SERVING, "triton:vllm")),
)


@dataclass(frozen=True)
class Card:
    spec: Spec
    ours: Row
    theirs: Row
    ratio: float  # how many times better ours is

    @property
    def headline(self) -> str:
        return fmt.change(self.ratio) if self.spec.export else fmt.ratio(self.ratio)

    @property
    def verdict(self) -> str:
        if self.spec.export and abs(self.ratio - 1) < SAME_SPEED:
            return "the same speed"
        return "faster" if self.ratio >= 1 else "slower"


def _fastest(results: Results, side: Side, metric: str) -> Row | None:
    rows = [r for r in results.rows if r.value(metric) is not None and side.group in (None, r.group)
            and fnmatchcase(r.id.partition("@")[0], side.ids) and (r.linnet or not side.linnet)]
    if not rows:
        return None
    return (min if METRICS[metric] else max)(rows, key=lambda r: r.measured(metric))


def _ratio(ours: Row, theirs: Row, metric: str) -> float:
    """The ratio the row recorded against that very row (from unrounded values), else the values'."""
    a = ours.against
    if a is not None and a.row == theirs.id and a.metric == metric:
        return a.ratio
    mine, other = ours.measured(metric), theirs.measured(metric)
    return other / mine if METRICS[metric] else mine / other


def cards(results: Results) -> list[Card]:
    found = []
    for spec in SPECS:
        ours, theirs = _fastest(results, spec.ours, spec.metric), _fastest(results, spec.theirs, spec.metric)
        if ours is not None and theirs is not None:
            found.append(Card(spec, ours, theirs, _ratio(ours, theirs, spec.metric)))
    return found

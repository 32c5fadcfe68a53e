"""What the mixture-of-experts families share: the sparse MLP (the Program's ``moe`` op, with a shared
expert beside it where there is one), layer kinds that mark the dense layers among the sparse ones, the
config reading, and the experts' tensor names.

The experts' canonical tensors are stacks: ``expert_gate`` and ``expert_up`` [E, F, D] and ``expert_down``
[E, D, F] (each expert's matrix in a linear's [out, in] layout), beside ``router`` [E, D]. transformers 5
keeps gate and up as one ``experts.gate_up_proj`` [E, 2F, D] (gate first) and down as ``experts.down_proj``;
older checkpoints hold one tensor per expert, which the loader stacks (``Architecture.hf_alternatives``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import Keys

from linnet.arch import Packed
from linnet.arch.blocks import mlp, pre_norm_layer
from linnet.errors import UnsupportedModel
from linnet.spec import MoeSpec

if TYPE_CHECKING:
    from linnet.gguf.reader import GGUFKeys
    from linnet.program.builder import SectionBuilder
    from linnet.spec import ConfigReader, ModelSpec


def layer_kinds(spec: ModelSpec) -> tuple[str, ...]:
    """Each layer's kind as ``blocks.layer_kinds`` names it, with "-dense" after the attention's type for
    a layer whose MLP is dense ("full-dense")."""
    dense = spec.moe.dense_layers if spec.moe is not None else ()
    return tuple(spec.layer_type(i) + ("-dense" if i in dense else "") + ("-nope" if i in spec.nope_layers else "")
                 for i in range(spec.num_layers))


def sparse_mlp(b: SectionBuilder, h: str) -> str:
    """The routed experts on h; plus, where there is one, the shared expert scaled by
    sigmoid(shared_expert_gate . h) (Qwen2-MoE)."""
    moe = b.spec.moe
    assert moe is not None
    out = b.moe(h, moe)
    if not moe.shared_size:
        return out
    shared = mlp(b, h, "shared_", moe.shared_size)
    logit = b.linear(h, "shared_expert_gate", 1, hint="shared_logit")
    # sigmoid(z) = (1 + tanh(z / 2)) / 2: ops every emitter has
    bent = b.op("tanh", (b.scale(logit, 0.5, "shared_logit_half"),), "shared_tanh")
    weight = b.op("shift", (b.scale(bent, 0.5, "shared_tanh_half"),), "shared_weight", {"amount": 0.5})
    return b.add(out, b.mul(shared, weight, "shared_out"), "ffn_out")


def layer(b: SectionBuilder, kind: str, qk_norm: str | None = None) -> str:
    """Llama's pre-norm layer with the sparse MLP, or the dense one on a "-dense" kind."""
    return pre_norm_layer(b, kind, qk_norm, mlp if "-dense" in kind else sparse_mlp)


# -- config ---------------------------------------------------------------------------------------------------

BOTH = ("num_experts", "num_local_experts")  # configs whose class maps either spelling to the other


def read(c: ConfigReader, experts: tuple[str, ...], size: str = "intermediate_size", **fields: Any) -> MoeSpec:
    """The experts' count (the first of the keys ``experts`` present), top k (``num_experts_per_tok``)
    and width (key ``size``), with the family's other fields."""
    key = next((k for k in experts if c.config.get(k) is not None), experts[0])
    return MoeSpec(experts=c.count(key), top_k=c.count("num_experts_per_tok"), size=c.count(size), **fields)


def qwen_dense_layers(c: ConfigReader) -> tuple[int, ...]:
    """Qwen-MoE's dense layers: those ``mlp_only_layers`` lists, and those ``decoder_sparse_step`` passes
    over (layer i is sparse where (i + 1) % step == 0)."""
    layers = c.count("num_hidden_layers")
    only = c.get("mlp_only_layers", [], list)
    if any(type(i) is not int or not 0 <= i < layers for i in only):
        raise UnsupportedModel(f"{c.where}: mlp_only_layers must be layer indices, got {only!r}")
    step = c.count("decoder_sparse_step", 1)
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


# -- names ----------------------------------------------------------------------------------------------------

def _halves(spec: ModelSpec, fused: np.ndarray) -> tuple[np.ndarray, ...]:
    assert spec.moe is not None
    return fused[:, :spec.moe.size], fused[:, spec.moe.size:]


GATE_UP = Packed(("expert_gate", "expert_up"), _halves, lambda spec, parts: np.concatenate(parts, axis=1))


def expert_names(prefix: str, router: str = "gate") -> dict[str, tuple[str | None, str | None]]:
    """The router's and experts' names (HF, GGUF) in transformers 5's layout under ``prefix``
    ("model.layers.{i}.mlp"); gate and up are packed (``packed``)."""
    return {"router": (f"{prefix}.{router}.weight", "blk.{i}.ffn_gate_inp.weight"),
            "expert_gate": (None, "blk.{i}.ffn_gate_exps.weight"), "expert_up": (None, "blk.{i}.ffn_up_exps.weight"),
            "expert_down": (f"{prefix}.experts.down_proj", "blk.{i}.ffn_down_exps.weight")}


def packed(prefix: str) -> dict[str, Packed]:
    return {f"{prefix}.experts.gate_up_proj": GATE_UP}


def per_expert(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> dict[str, str]:
    """The older layout's names: one tensor per expert under ``prefix``."""
    return {"expert_gate": f"{prefix}.experts.{{e}}.{gate}.weight", "expert_up": f"{prefix}.experts.{{e}}.{up}.weight",
            "expert_down": f"{prefix}.experts.{{e}}.{down}.weight"}


def shared_names(prefix: str) -> dict[str, tuple[str | None, str | None]]:
    """Qwen2-MoE's shared expert and its gate under ``prefix``; GGUF's gate is ``SHARED_GATE``."""
    return {"shared_gate": (f"{prefix}.shared_expert.gate_proj.weight", "blk.{i}.ffn_gate_shexp.weight"),
            "shared_up": (f"{prefix}.shared_expert.up_proj.weight", "blk.{i}.ffn_up_shexp.weight"),
            "shared_down": (f"{prefix}.shared_expert.down_proj.weight", "blk.{i}.ffn_down_shexp.weight"),
            "shared_expert_gate": (f"{prefix}.shared_expert_gate.weight", None)}


# Qwen2-MoE's shared expert gate: [1, D] in HF and in Linnet, [D] in llama.cpp's converted files (its graph
# takes either); read as [1, D] whichever the file holds, written as it is
SHARED_GATE = Packed(("shared_expert_gate",), lambda spec, a: (a.reshape(1, -1),), lambda spec, parts: parts[0])


# -- checkpoint forms -----------------------------------------------------------------------------------------

def hf_config(spec: ModelSpec, count: str = "num_experts", size: str | None = None) -> dict[str, Any]:
    """config.json's expert keys: their count (key ``count``), top k, and each expert's width where the
    family keys it apart from intermediate_size (key ``size``)."""
    moe = _moe(spec)
    return {count: moe.experts, "num_experts_per_tok": moe.top_k, **({size: moe.size} if size else {})}


def qwen_hf_layers(spec: ModelSpec) -> dict[str, Any]:
    """Qwen-MoE's dense layers, listed (every layer sparse but those)."""
    return {"decoder_sparse_step": 1, "mlp_only_layers": list(_moe(spec).dense_layers)}


def _key(template: str) -> str:
    return template.removeprefix("{arch}.")  # gguf's "{arch}.expert_count": the family's own key


EXPERT_COUNT, EXPERT_USED, EXPERT_SIZE, SHARED_SIZE, WEIGHTS_SCALE = map(_key, (
    Keys.LLM.EXPERT_COUNT, Keys.LLM.EXPERT_USED_COUNT, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
    Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, Keys.LLM.EXPERT_WEIGHTS_SCALE))


def gguf_config(keys: GGUFKeys, size: int | None = None, **fields: Any) -> MoeSpec:
    """The experts as llama.cpp's graph of ``keys.family`` runs them: their count, top k and each one's
    width (``size``; default feed_forward_length); the family's graph fixes how the router weighs them
    (``fields``), whatever expert_weights_norm or expert_gating_func say. expert_weights_scale, which
    llama.cpp's versions apply differently, is read only where it scales by 1."""
    scale = keys.meta.get(f"{keys.family}.{WEIGHTS_SCALE}", 1.0)
    if scale != 1.0:
        raise UnsupportedModel(f"{keys.where}: {keys.family}.{WEIGHTS_SCALE} {scale!r}: Linnet reads the experts' "
                               "weights unscaled only, as every llama.cpp version applies them")
    return MoeSpec(experts=keys.number(EXPERT_COUNT), top_k=keys.number(EXPERT_USED),
                   size=size or keys.number("feed_forward_length"), **fields)


def gguf_expert_size(keys: GGUFKeys) -> int:
    """expert_feed_forward_length, or llama.cpp's qwen graphs' default: feed_forward_length / top k."""
    return keys.number(EXPERT_SIZE, keys.number("feed_forward_length") // keys.number(EXPERT_USED))


def gguf_metadata(spec: ModelSpec, size: str | None = None) -> dict[str, Any]:
    """llama.cpp's expert keys: count, top k, each expert's width where the family keys it apart from
    feed_forward_length (key ``size``), and a shared expert's."""
    moe = _moe(spec)
    return {EXPERT_COUNT: moe.experts, EXPERT_USED: moe.top_k, **({size: moe.size} if size else {}),
            **({SHARED_SIZE: moe.shared_size} if moe.shared_size else {})}


def all_sparse(spec: ModelSpec, graph: str) -> None:
    """Graphs whose every layer is a mixture of experts."""
    dense = _moe(spec).dense_layers
    if dense:
        raise UnsupportedModel(f"{graph} has no dense layers among the sparse ones; {spec.architecture}'s "
                               f"layers {list(dense)} are dense")


def _moe(spec: ModelSpec) -> MoeSpec:
    assert spec.moe is not None, spec.architecture  # a mixture-of-experts family's spec has one
    return spec.moe

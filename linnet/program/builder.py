"""The small API an architecture builds its Program with: ``x = b.rms_norm(x, "attn_norm")``.

A ``SectionBuilder`` appends ops to one section, names their values, checks their types as it goes,
and records each weight it reads with its shape (the checkpoint's tensors are what the builders read).
``build_program`` runs an architecture's builders: the embedding, one layer of each kind, the head.
"""
from __future__ import annotations

from typing import Any

from linnet.errors import LinnetError
from linnet.program.ir import Op, Program, Section, Value, cache_dtype, step_inputs
from linnet.program.ops import infer_op
from linnet.spec import ModelSpec, MoeSpec


class SectionBuilder:
    def __init__(self, spec: ModelSpec, act: str, weight_dtype: str, params: dict[str, Value]):
        self.spec = spec
        self.act = act
        self.weight_dtype = weight_dtype
        self.params = tuple(params)
        self.env: dict[str, Value] = {**step_inputs(spec, act), **params}
        self.ops: list[Op] = []
        self.weights: dict[str, tuple[int, ...]] = {}

    # -- the core ----------------------------------------------------------------------------------------

    def fresh(self, hint: str) -> str:
        name, n = hint, 1
        while name in self.env:
            n += 1
            name = f"{hint}_{n}"
        return name

    def op(self, kind: str, inputs: tuple[str, ...], hint: str, attrs: dict[str, Any] | None = None,
           outs: int = 1) -> Any:
        """Append an op; its output's name (or names, with ``outs`` > 1), made from ``hint``."""
        names = tuple(self.fresh(hint if outs == 1 else f"{hint}{i}") for i in range(outs))  # distinct hints
        self.named(kind, inputs, names, attrs)
        return names[0] if outs == 1 else names

    def named(self, kind: str, inputs: tuple[str, ...], names: tuple[str, ...],
              attrs: dict[str, Any] | None = None) -> None:
        """Append an op whose outputs take the given names (a layer's cache results, a split's parts)."""
        op = Op(kind, names, inputs, attrs or {})
        taken = [n for n in names if n in self.env]
        if taken:
            raise LinnetError(f"values {taken} are assigned twice")
        self.env.update(zip(names, infer_op(op, [self.env[i] for i in inputs], self.spec, self.act), strict=True))
        self.ops.append(op)

    def weight(self, name: str, shape: tuple[int, ...]) -> str:
        """``w.<name>``, a tensor of the checkpoint with this shape."""
        known = self.weights.setdefault(name, shape)
        if known != shape:
            raise LinnetError(f"weight {name!r} is read as {shape} and as {known}")
        key = f"w.{name}"
        self.env.setdefault(key, Value(shape, self.weight_dtype))
        return key

    def width(self, x: str) -> int:
        last = self.env[x].shape[-1]
        assert isinstance(last, int)
        return last

    def section(self, results: tuple[str, ...]) -> Section:
        return Section(self.params, tuple(self.ops), results)

    # -- ops ---------------------------------------------------------------------------------------------

    def embedding(self, name: str = "embed") -> str:
        return self.op("embedding", ("tokens", self.weight(name, (self.spec.vocab_size, self.spec.hidden_size))), "x")

    def linear(self, x: str, name: str, out: int, bias: bool = False, hint: str | None = None) -> str:
        inputs: tuple[str, ...] = (x, self.weight(name, (out, self.width(x))))
        if bias:
            inputs += (self.weight(f"{name}_bias", (out,)),)
        return self.op("linear", inputs, hint or name)

    def rms_norm(self, x: str, name: str, hint: str = "h") -> str:
        return self.op("rms_norm", (x, self.weight(name, (self.width(x),))), hint, {"eps": self.spec.rms_norm_eps})

    def layer_norm(self, x: str, name: str, hint: str = "h") -> str:
        """LayerNorm with a weight and a bias (``<name>`` and ``<name>_bias``)."""
        width = (self.width(x),)
        return self.op("layer_norm", (x, self.weight(name, width), self.weight(f"{name}_bias", width)), hint,
                       {"eps": self.spec.rms_norm_eps, "dtype": self.env[x].dtype})

    def norm(self, x: str, name: str, hint: str = "h") -> str:
        """The spec's norm: RMS, or LayerNorm with a bias."""
        return self.layer_norm(x, name, hint) if self.spec.norm == "layer" else self.rms_norm(x, name, hint)

    def add(self, a: str, b: str, hint: str = "x") -> str:
        return self.op("add", (a, b), hint)

    def mul(self, a: str, b: str, hint: str = "m") -> str:
        return self.op("mul", (a, b), hint)

    def scale(self, x: str, factor: float, hint: str | None = None) -> str:
        """x * factor; x itself when the factor is 1."""
        return x if factor == 1.0 else self.op("scale", (x,), hint or f"{x}_scaled", {"factor": float(factor)})

    def softcap(self, x: str, cap: float | None, hint: str | None = None) -> str:
        """cap * tanh(x / cap); x itself without a cap."""
        return x if cap is None else self.op("softcap", (x,), hint or f"{x}_capped", {"cap": float(cap)})

    def activation(self, x: str, fn: str, hint: str = "act") -> str:
        return self.op("activation", (x,), hint, {"fn": fn})

    def split_heads(self, x: str, heads: int, hint: str) -> str:
        return self.op("split_heads", (x,), hint, {"heads": heads})

    def rotary(self, x: str, hint: str, table: int = 0) -> str:
        """Rotary embedding of x's first ``rotary_dim`` dims per head by rotary table ``table`` (0: the
        spec's rope, 1: its local rope); the rest pass through."""
        rd, d = self.spec.rotary_dim, self.spec.head_dim
        tables = ("positions", "rope_cos", "rope_sin")
        attrs = {"table": table} if table else None  # table 0 is the op without the attr
        if rd == d:
            return self.op("rotary", (x, *tables), hint, attrs)
        rotated, kept = self.op("split", (x,), f"{hint}_part", {"sizes": (rd, d - rd)}, outs=2)
        return self.op("concat", (self.op("rotary", (rotated, *tables), f"{hint}_rotated", attrs), kept), hint)

    def cache_write(self, cache: str, value: str, out: str) -> str:
        self.named("cache_write", (cache, "rows", "positions", value), (out,))
        return out

    def attention(self, q: str, cache_k: str, cache_v: str, scale: float, softcap: float | None = None,
                  window: int | None = None, sinks: str | None = None) -> str:
        """``sinks``: the weight of a logit per head in the softmax (gpt-oss)."""
        attrs: dict[str, Any] = {"scale": float(scale)}
        if softcap is not None:
            attrs["softcap"] = float(softcap)
        if window is not None:
            attrs["window"] = window
        extra: tuple[str, ...] = ()
        if sinks is not None:
            attrs["sinks"] = True
            extra = (self.weight(sinks, (self.spec.num_heads,)),)
        return self.op("attention", (q, cache_k, cache_v, "rows", "positions", *extra), "attn", attrs)

    def moe(self, x: str, moe: MoeSpec, hint: str = "moe_out") -> str:
        """The routed experts of ``moe`` on x: weights ``router`` [E, D], ``expert_gate``/``expert_up`` [E, F, D]
        and ``expert_down`` [E, D, F], with ``router_bias`` and ``expert_*_bias`` where the spec has them."""
        d, e, f = self.width(x), moe.experts, moe.size
        inputs: tuple[str, ...] = (x, self.weight("router", (e, d)), self.weight("expert_gate", (e, f, d)),
                  self.weight("expert_up", (e, f, d)), self.weight("expert_down", (e, d, f)))
        attrs: dict[str, Any] = {"top_k": moe.top_k, "gating": moe.gating}
        if moe.normalize:
            attrs["normalize"] = True
        attrs["activation"] = moe.activation
        if moe.alpha is not None and moe.limit is not None:  # clamped_swiglu's
            attrs.update(alpha=float(moe.alpha), limit=float(moe.limit))
        if moe.router_bias:
            attrs["router_bias"] = True
            inputs += (self.weight("router_bias", (e,)),)
        if moe.expert_bias:
            attrs["expert_bias"] = True
            inputs += (self.weight("expert_gate_bias", (e, f)), self.weight("expert_up_bias", (e, f)),
                       self.weight("expert_down_bias", (e, d)))
        return self.op("moe", inputs, hint, attrs)

    def select(self, x: str) -> str:
        return self.op("select", (x, "select"), "x_sel")

    def cast(self, x: str, dtype: str, hint: str) -> str:
        return self.op("cast", (x,), hint, {"dtype": dtype})


def build_program(spec: ModelSpec, dtype: str = "f32", weight_dtype: str | None = None) -> Program:
    """The step of ``spec`` computing in ``dtype``, with weights stored in ``weight_dtype`` (default:
    ``dtype``), as its architecture builds it."""
    from linnet.arch import get_architecture
    from linnet.program.passes import checked

    arch = get_architecture(spec.architecture)
    wd = weight_dtype or dtype
    x = Value(("R", "T", spec.hidden_size), dtype)
    cache = step_inputs(spec, dtype, cache_dtype(dtype, wd))["cache_k"]

    embed = SectionBuilder(spec, dtype, wd, {})
    embed_section = embed.section((arch.embed(embed),))
    layer_kinds = arch.layer_kinds(spec)
    kinds, layer_weights = {}, {}
    for kind in dict.fromkeys(layer_kinds):
        b = SectionBuilder(spec, dtype, wd, {"x": x, "cache_k": cache, "cache_v": cache})
        out = arch.layer(b, kind)
        kinds[kind] = b.section((out, "cache_k_out", "cache_v_out"))
        layer_weights[kind] = b.weights
    head = SectionBuilder(spec, dtype, wd, {"x": x})
    head_section = head.section((arch.head(head),))
    top = {**embed.weights, **head.weights}
    if spec.tie_word_embeddings:
        top.pop("lm_head", None)
    program = Program(spec=spec, dtype=dtype, weight_dtype=wd, embed=embed_section, kinds=kinds,
                      layer_kinds=layer_kinds, head=head_section, weight_shapes=top, layer_weight_shapes=layer_weights)
    return checked(program)  # every program built or rewritten here is checked

"""ONNX Runtime's contrib forms of the Program's ops (the ``ort`` variant), over the plain lowering (``lower``).

Each form here replaces one op's standard operators where ONNX Runtime has one kernel for them:

- SimplifiedLayerNormalization for an RMS norm (accumulated in float32 for every input type);
- FusedMatMul for a product, which reads a weight as stored ([out, in]) from activations of any rank,
  so that no reshape surrounds it; per-head values stay flat ([R, T, heads * D]) until an op needs the
  heads apart;
- com.microsoft RotaryEmbedding, on half tables in the compute dtype (``rope_initializers``);
- matrices the Program holds in llama.cpp's blocks: MatMulNBits products and GatherBlockQuantized rows on
  their codes (``blocks``), with ``Program.int8_activations`` as MatMulNBits' accuracy level 4;
- com.microsoft MoE for a mixture of experts;
- with ``attention="gqa"``: GroupQueryAttention over cache rows bound in order (the runner binds a window
  of them), which appends the new keys and values and reads only the valid length, in one kernel (its
  scale, softcap and local_window_size attributes are the Program's attrs). It places the new tokens at
  each row's length, so each step's positions must be contiguous (``positions[t] = positions[0] + t``):
  the runner sees to that. A ring cache is beyond it: a ring layer's attention keeps the gather form.

Rewrites that join several ops' nodes into one kernel (a norm taking the residual add in, the rotations
taken into GroupQueryAttention) run after emission, over the whole graph (``passes``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from linnet.backends.onnx.blocks import bits, block_size
from linnet.backends.onnx.lower import ATTENTION_ATTRS, Emitter, GraphOptions, refuse_unknown_attrs
from linnet.dtypes import DTYPES
from linnet.program import Op, Program

# ONNX Runtime's MoE kernel reads each expert's gate and up rows interleaved in one matrix (row 2j gate's row
# j, row 2j + 1 up's): the weights hold that form beside the Program's stacks (``export.planned_arrays``).
INTERLEAVED = {"expert_gate_up": ("expert_gate", "expert_up"),
               "expert_gate_up_bias": ("expert_gate_bias", "expert_up_bias")}


def with_interleaved(blocks: dict[str, str]) -> dict[str, str]:
    """Weights in blocks by full name and form (``quantize.block_names``), with each layer's interleaved
    gate and up where its gate stack is in blocks: interleaving rows of blocks interleaves their values."""
    out = dict(blocks)
    for name, form in blocks.items():
        for fused, (gate, _) in INTERLEAVED.items():
            if name.endswith("." + gate):
                out[name.removesuffix(gate) + fused] = form
    return out


@dataclass(frozen=True)
class BlockWeight:
    """A matrix [n, k] in one of llama.cpp's block forms, as MatMulNBits' initializers (``blocks.PARTS``)."""
    form: str
    n: int
    k: int
    parts: dict[str, str]  # part -> initializer name


class OrtEmitter(Emitter):
    """The plain lowering with ONNX Runtime's com.microsoft kernels where they replace several operators."""

    contrib = True

    def __init__(self, program: Program, options: GraphOptions):
        super().__init__(program, options)
        self.gqa = options.attention == "gqa"
        self.attention_positions = "gqa_positions" if options.ragged else "positions"  # the kernel's rows'
        self._appended: dict[str, tuple[str, str]] = {}  # gqa: a cache's output -> (the cache, the flat new values)
        self.blocks: dict[str, BlockWeight] = {}  # a weight's name -> its blocks, for a matrix in blocks
        # MatMulNBits' accuracy level 4 rounds x to int8 per block, as Program.int8_activations defines
        self.block_accuracy = 4 if program.int8_activations else 0

    def rope_initializers(self, positions: int) -> list[onnx.TensorProto]:
        """The half tables in the compute dtype, rounded to the run dtype, that com.microsoft
        RotaryEmbedding takes: each table's first half, its own initializer."""
        from linnet.rope import rope_tables

        cos, sin = rope_tables(self.spec, positions)
        width, tables = self.spec.rotary_dim, []
        for index in range(self.spec.rope_table_count):
            for name, table in (("cos", cos), ("sin", sin)):
                half = half_table(name, index)
                columns = table[:, index * width:index * width + width // 2]
                rounded = columns.astype(DTYPES[self.act].numpy).astype(DTYPES[self.compute].numpy)
                tables.append(onnx.numpy_helper.from_array(np.ascontiguousarray(rounded), f"rope_{half}"))
                self._shared[half] = f"rope_{half}"
                self.names.add(f"rope_{half}")
        return tables

    # -- the Program's ops, in contrib forms ---------------------------------------------------------
    def op_embedding(self, op: Op, tokens: str, table: str) -> str:
        if table in self.blocks:
            return self._block_gather(self.blocks[table], tokens)
        return super().op_embedding(op, tokens, table)

    def op_rms_norm(self, op: Op, x: str, w: str) -> str:
        """SimplifiedLayerNormalization: accumulates in float32 for every input type (stash_type 1)."""
        return self.rounded(self.node("SimplifiedLayerNormalization", [x, w], "norm", axis=-1,
                                      epsilon=op.attrs["eps"]))

    def op_linear(self, op: Op, x: str, w: str, b: str | None = None) -> str:
        if w in self.blocks:
            y = self._block_matmul(self.blocks[w], x)
        else:  # [..., in] x [out, in]^T, any leading axes
            y = self.node("FusedMatMul", [x, w], "matmul", domain="com.microsoft", transB=1)
        return self.rounded(self.node("Add", [y, b], "biased") if b else y)

    def op_split_heads(self, op: Op, x: str) -> str:
        """Reshaped only if an op needs the heads apart (``heads``)."""
        return self.flat_heads(x, op.attrs["heads"], self.head_dim(op))

    def op_rotary(self, op: Op, x: str, positions: str, cos: str, sin: str) -> str:
        """com.microsoft RotaryEmbedding: [R, T, heads, D] as [R, T, heads * D]."""
        refuse_unknown_attrs(op, {"table"}, "rotary")
        _, _, heads, width = self.types[op.inputs[0]].shape  # width: the head's, or its rotated part's
        assert isinstance(heads, int) and isinstance(width, int)
        table = op.attrs.get("table", 0)
        cos_half, sin_half = self._shared[half_table("cos", table)], self._shared[half_table("sin", table)]
        y = self.node("RotaryEmbedding", [self.flat(x), positions, cos_half, sin_half], "rot",
                      domain="com.microsoft", interleaved=0, num_heads=heads)
        return self.flat_heads(self.rounded(y), heads, width)

    def op_cache_write(self, op: Op, cache: str, rows: str, positions: str, v: str) -> str:
        """With GroupQueryAttention, nothing yet: the kernel appends the values (``op_attention``)."""
        if self.gqa and "ring" not in op.attrs:
            out = f"{cache}.out"  # the step's output, as the plain form names it
            self.names.add(out)
            self._appended[out] = (cache, self.flat(v))
            return out
        return super().op_cache_write(op, cache, rows, positions, v)

    def op_attention(self, op: Op, q: str, cache_k: str, cache_v: str, rows: str, positions: str,
                     sinks: str | None = None) -> str:
        refuse_unknown_attrs(op, ATTENTION_ATTRS, "attention")
        if self.gqa and "ring" not in op.attrs:  # a ring is beyond GroupQueryAttention: the plain form reads it
            return self._group_query_attention(op, q, cache_k, cache_v, sinks)
        return super().op_attention(op, q, cache_k, cache_v, rows, positions, sinks)

    # -- matrices in blocks --------------------------------------------------------------------------
    def _block_matmul(self, w: BlockWeight, x: str) -> str:
        """x [R, T, k] times a matrix in blocks: com.microsoft MatMulNBits on its codes (``blocks``); for
        a form with mins, plus each block's min times the block's sum of x."""
        zero_points = [w.parts["zero_points"]] if "zero_points" in w.parts else []
        size = block_size(w.form)
        y = self.node("MatMulNBits", [x, w.parts["codes"], w.parts["scales"], *zero_points], "matmul_blocks",
                      domain="com.microsoft", K=w.k, N=w.n, bits=bits(w.form), block_size=size,
                      accuracy_level=self.block_accuracy)
        if "mins" not in w.parts:
            return y
        per_block = self.node("Reshape", [x, self.ints(0, 0, w.k // size, size)], "x_blocks")
        sums = self.node("ReduceSum", [per_block, self.ints(-1)], "x_block_sums", keepdims=0)
        mins = self.node("FusedMatMul", [sums, w.parts["mins"]], "matmul_mins", domain="com.microsoft", transB=1)
        return self.node("Add", [y, mins], "matmul_mins_added")

    def _block_gather(self, w: BlockWeight, tokens: str) -> str:
        """Rows of a matrix in blocks: com.microsoft GatherBlockQuantized on the codes MatMulNBits reads
        ([n, k / block, block * bits / 8], each block's scale on an axis of its own), then [R, T, k]."""
        scales = self.node("Unsqueeze", [w.parts["scales"], self.ints(-1)], "embed_scales")
        size, width = block_size(w.form), bits(w.form)
        zero_points = []
        if "zero_points" in w.parts and width == 8:  # one a byte: the same values on an axis of their own
            zero_points = [self.node("Unsqueeze", [w.parts["zero_points"], self.ints(-1)], "embed_zero_points")]
        elif "zero_points" in w.parts:  # 4 bits: the forms with mins, whose zero points are 0
            zero_points = [self.const("embed_zero_points", np.zeros((w.n, w.k // size, 1), np.uint8))]
        rows = self.node("GatherBlockQuantized", [w.parts["codes"], tokens, scales, *zero_points], "x_blocks",
                         domain="com.microsoft", bits=width, block_size=size, gather_axis=0, quantize_axis=2)
        if "mins" in w.parts:  # [R, T, k / block, block] + [R, T, k / block, 1]
            mins = self.node("Gather", [w.parts["mins"], tokens], "x_mins", axis=0)
            rows = self.node("Add", [rows, self.node("Unsqueeze", [mins, self.ints(-1)], "x_mins_b")], "x_with_mins")
        return self.node("Reshape", [rows, self.ints(0, 0, w.k)], "x")

    # -- GroupQueryAttention and MoE -----------------------------------------------------------------
    def _group_query_attention(self, op: Op, q: str, cache_k: str, cache_v: str, sinks: str | None = None) -> str:
        """com.microsoft GroupQueryAttention: appends the new keys and values to each bound cache row at its
        length (its positions[0]) in place, and attends over the valid length only. Its softcap bends the
        scaled scores before the softmax, as the Program's does; its local_window_size W, in ONNX Runtime
        1.32's CPU kernel, is the Program's window: W keys, the query's own included (older sources kept
        W + 1; tests/backends/onnx pins it). Sinks are its head_sink input (its twelfth). Rotations that
        only feed it are taken in afterwards (``passes.rotary_into_group_query_attention``)."""
        _, _, heads, _ = self.types[op.inputs[0]].shape  # q [R, T, HEADS, D]
        attrs: dict[str, Any] = {"scale": op.attrs["scale"]}
        if "softcap" in op.attrs:
            attrs["softcap"] = op.attrs["softcap"]
        if "window" in op.attrs:
            attrs["local_window_size"] = op.attrs["window"]
        (past_k, k), (past_v, v) = self._appended.pop(cache_k), self._appended.pop(cache_v)
        seqlens, total = self._gqa_lengths()
        out = self.fresh("attn")
        # after the lengths: the rotary tables, position_ids and attention_bias (none), head_sink, the cache's
        # scales and q/k norm weights (none), and query_seqlens
        rest = ["", "", "", "", sinks or "", "", "", "", "", self._gqa_query_lengths()]
        self.nodes.append(helper.make_node(
            "GroupQueryAttention", [self.flat(q), k, v, past_k, past_v, seqlens, total, *rest],
            [out, cache_k, cache_v], name=out, domain="com.microsoft", num_heads=heads,
            kv_num_heads=self.kv_heads(op.inputs[1]), **attrs))
        return self.rounded(out)

    def _gqa_lengths(self) -> tuple[str, str]:
        """GroupQueryAttention's lengths: per row its last position ([R] int32, "seqlens_k") and the
        longest row's length (an int32 scalar)."""
        def build() -> tuple[str, str]:
            last = self.node("ReduceMax", [self.attention_positions, self.ints(1)], "last_pos", keepdims=0)
            longest = self.node("Add", [self.node("ReduceMax", [last], "max_pos", keepdims=0), self._one()], "total")
            return self.cast(last, "i32", "seqlens_k"), self.cast(longest, "i32", "total_len")
        return self._once("gqa_lengths", build)

    def _gqa_query_lengths(self) -> str:
        """GroupQueryAttention's query_seqlens: every row's chunk is whole ([R] int32, each the step's
        length). Given, the kernel reads several rows of several tokens that follow a past in one call."""
        def build() -> str:
            rows = self.node("Shape", [self.attention_positions], "step_rows", start=0, end=1)
            length = self.node("Shape", [self.attention_positions], "step_length", start=1, end=2)
            return self.cast(self.node("Expand", [length, rows], "query_lengths"), "i32", "query_seqlens")
        return self._once("gqa_query_lengths", build)

    def experts(self, op: Op, x: str, logits: str, stacks: tuple[str, str, str],
                biases: tuple[str | None, ...]) -> str:
        """com.microsoft MoE, which runs each expert on the tokens that chose it: a softmax over the
        router's logits, each token's top k, their weights renormalised where asked (a softmax over the top
        k logits is the renormalised top k of the one over all), gate and up interleaved in one matrix
        (``INTERLEAVED``: the one layout its CPU kernel takes), the activation g' sigmoid(alpha g')
        (u' + beta), g' and u' clamped at the limit where there is one."""
        attrs, down, down_bias = op.attrs, stacks[2], biases[2]
        clamped = attrs["activation"] == "clamped_swiglu"
        renormalise = attrs["gating"] == "topk_softmax" or attrs.get("normalize", False)
        options: dict[str, Any] = {"k": attrs["top_k"], "activation_type": "swiglu", "swiglu_fusion": 1,
                                   "normalize_routing_weights": int(renormalise),
                                   "activation_alpha": attrs.get("alpha", 1.0), "activation_beta": float(clamped)}
        if clamped:
            options["swiglu_limit"] = attrs["limit"]
        gate_up = self.weight("expert_gate_up")
        gate_up_bias = self.weight("expert_gate_up_bias") if down_bias else ""
        experts = int(self.types[op.inputs[1]].shape[0])
        router_logits = self.node("Reshape", [logits, self.ints(-1, experts)], "router_logits")
        if gate_up in self.blocks:
            return self.rounded(self._quantized_experts(x, router_logits, gate_up, gate_up_bias, down,
                                                        down_bias or "", options))
        y = self.node("MoE", [x, router_logits, gate_up, gate_up_bias, down, down_bias or ""], "moe",
                      domain="com.microsoft", **options)
        return self.rounded(y)

    def _quantized_experts(self, x: str, router_logits: str, gate_up: str, gate_up_bias: str, down: str,
                           down_bias: str, options: dict[str, Any]) -> str:
        """com.microsoft QMoE: MoE on stacks in blocks (``blocks.stack_parts``), each chosen expert's codes
        read in place; its 8-bit products round x to int8 per block at every accuracy level, its 4-bit ones
        at level 4, which ``Program.int8_activations`` asks for."""
        fc1, fc2 = self.blocks.get(gate_up), self.blocks.get(down)
        if fc1 is None or fc2 is None or fc1.form != fc2.form or not self.block_accuracy:
            raise ValueError("QMoE needs the experts' gate, up and down in blocks of one form, with int8 "
                             "activations")
        tokens = self.node("Reshape", [x, self.ints(-1, fc1.k)], "moe_tokens")
        y = self.node("QMoE", [tokens, router_logits, fc1.parts["codes"], fc1.parts["scales"], gate_up_bias,
                               fc2.parts["codes"], fc2.parts["scales"], down_bias], "qmoe", domain="com.microsoft",
                      expert_weight_bits=bits(fc1.form), block_size=block_size(fc1.form),
                      accuracy_level=self.block_accuracy, **options)
        return self.node("Reshape", [y, self.node("Shape", [x], "moe_x_shape")], "moe")


def half_table(name: str, table: int) -> str:
    """The half table of rotary table ``table``: ``cos_half``, ``cos_half.1``, ..."""
    return f"{name}_half" + (f".{table}" if table else "")

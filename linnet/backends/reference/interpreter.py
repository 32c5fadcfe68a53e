"""Execute a Program op by op in NumPy, exactly as ``linnet.program``'s docstring defines each op.

Plain on purpose: this is the executable definition other backends are checked against, not a fast path.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from linnet.errors import LinnetError
from linnet.program import Op, Program, Section
from linnet.quantize import Affine, affine, block_names, dequantized, int8_rounded

DTYPES = {"f32": np.float32, "i64": np.int64}


def run_step(
    program: Program,
    weights: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    caches: tuple[list[np.ndarray], list[np.ndarray]],
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(logits [R, S, vocab], new cache_k per layer, new cache_v per layer); nothing is updated in place."""
    act = DTYPES[program.dtype]
    rounded = _int8_products(program, weights)
    weights = _dequantized(program, weights)
    head_weights = {**weights, "lm_head": weights["embed"]} if program.spec.tie_word_embeddings else weights
    (x,) = _run(program.embed, {}, inputs, lambda n: weights[n], act, {})
    new_k, new_v = [], []
    for i, (cache_k, cache_v) in enumerate(zip(*caches)):
        params = {"x": x, "cache_k": cache_k, "cache_v": cache_v}
        prefix = f"layers.{i}."
        x, k, v = _run(program.layer_section(i), params, inputs, lambda n, i=i: weights[f"layers.{i}.{n}"], act,
                       {"w." + n[len(prefix):]: m for n, m in rounded.items() if n.startswith(prefix)})
        new_k.append(k)
        new_v.append(v)
    tied = program.spec.tie_word_embeddings
    head_rounded = {"w." + ("lm_head" if tied and n == "embed" else n): m for n, m in rounded.items()
                    if not n.startswith("layers.")}
    (logits,) = _run(program.head, {"x": x}, inputs, lambda n: head_weights[n], act, head_rounded)
    return logits, new_k, new_v


def _dequantized(program: Program, weights: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """Block-quantised weights (``Program.quantized``) as the values their blocks stand for."""
    if not program.quantized:
        return weights
    out = dict(weights)
    for section, name, form in program.quantized:
        layers = range(program.spec.num_layers) if section == "layer" else [None]
        for full in (name if i is None else f"layers.{i}.{name}" for i in layers):
            out[full] = dequantized(weights[full], form)
    return out


def _int8_products(program: Program, weights: Mapping[str, np.ndarray]) -> dict[str, Affine]:
    """The matrices whose products round x to int8 (``Program.int8_activations``), by full name: their
    affine codes (``linnet.quantize.affine``: the block size and mins)."""
    if not program.int8_activations:
        return {}
    return {name: affine(weights[name], form) for name, form in block_names(program.quantized,
                                                                           program.spec.num_layers).items()}


def _run(section: Section, params: dict, inputs: Mapping[str, np.ndarray], weight: Callable, act: type,
         int8_products: Mapping[str, Affine]) -> list:
    """``int8_products``: weights (``w.<name>``) whose products round x to int8, and their affine codes."""
    env = {**inputs, **params}
    for op in section.ops:
        args = [weight(i[2:]) if i.startswith("w.") else env[i] for i in op.inputs]
        if op.kind == "linear" and op.inputs[1] in int8_products:
            outs = linear_int8(op, act, *args, codes=int8_products[op.inputs[1]])
        elif op.kind == "moe" and set(op.inputs) & set(int8_products):
            outs = moe(op, act, *args, int8_block=_stacks_block(op, int8_products))
        else:
            outs = OPS[op.kind](op, act, *args)
        env.update(zip(op.outs, outs if isinstance(outs, tuple) else (outs,)))
    return [env[r] for r in section.results]


def rms_norm(op: Op, act: type, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x32 = x.astype(np.float32)
    scale = 1.0 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(op.attrs["eps"]))
    return w * (x32 * scale).astype(act)


def linear(op: Op, act: type, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    y = x @ w.T
    return y if b is None else y + b


def linear_int8(op: Op, act: type, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *,
                codes: Affine) -> np.ndarray:
    """A product with a matrix in blocks under ``Program.int8_activations``: its codes meet x rounded to
    int8 per block of its scales; its mins [out, in / block], if any, meet each block's sum of x as it is."""
    rounded = int8_rounded(x, codes.block)
    if codes.mins is None:
        return linear(op, act, rounded, w, b)
    coded = w - np.repeat(codes.mins, codes.block, axis=1)  # scale * (code - zero)
    sums = x.reshape(*x.shape[:-1], -1, codes.block).sum(axis=-1)
    return linear(op, act, rounded, coded, b) + sums @ codes.mins.T


def rotary(op: Op, act: type, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    unknown = sorted(set(op.attrs) - {"table"})
    if unknown:
        raise LinnetError(f"the reference interpreter has no rotary attrs {unknown} (op {op})")
    width, table = x.shape[-1], op.attrs.get("table", 0)
    columns = slice(table * width, (table + 1) * width)  # table j's columns
    c = cos[positions][..., columns].astype(act)[:, :, None, :]  # [R, T, 1, D]: the same for every head
    s = sin[positions][..., columns].astype(act)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate((-x[..., half:], x[..., :half]), axis=-1)
    return x * c + rotated * s


def cache_write(op: Op, act: type, cache: np.ndarray, rows: np.ndarray, positions: np.ndarray, v: np.ndarray):
    out = cache.copy()
    if "ring" in op.attrs:  # a ring's slots: p mod N, the scratch position's the last
        ring = op.attrs["ring"]
        positions = np.where(positions == op.attrs["scratch"], ring, positions % ring)
    out[rows[:, None], :, positions] = v  # [R, T] indices around a slice: the indexed view is [R, T, KV, D]
    return out


def attention(op: Op, act: type, q, cache_k, cache_v, rows, positions, sinks=None) -> np.ndarray:
    r, t, heads, d = q.shape
    group = heads // cache_k.shape[1]
    keys = np.repeat(cache_k[rows], group, axis=1).astype(np.float32)  # [R, HEADS, P, D]
    values = np.repeat(cache_v[rows], group, axis=1).astype(np.float32)
    scores = np.einsum("rthd,rhpd->rthp", q.astype(np.float32), keys) * np.float32(op.attrs["scale"])
    if "softcap" in op.attrs:
        cap = np.float32(op.attrs["softcap"])
        scores = np.tanh(scores / cap) * cap
    key_positions = np.arange(keys.shape[2])[None, None, None, :]
    query = positions[:, :, None, None]
    if "ring" in op.attrs:  # the key of slot s is age = (q - s) mod N positions back; the last is scratch
        ring = op.attrs["ring"]
        age = (query - key_positions) % ring
        visible = (key_positions < ring) & (age < op.attrs["window"]) & (age <= query)
    else:
        visible = key_positions <= query
        if "window" in op.attrs:
            visible &= key_positions > query - op.attrs["window"]
    scores = np.where(visible, scores, -np.inf)
    if sinks is not None:  # a last logit per head, in the denominator only: it weighs no value
        sink = np.broadcast_to(sinks.astype(np.float32)[None, None, :, None], (*scores.shape[:3], 1))
        scores = np.concatenate((scores, sink), axis=-1)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = (weights / weights.sum(axis=-1, keepdims=True))[..., :values.shape[2]]
    out = np.einsum("rthp,rhpd->rthd", weights, values)
    return out.astype(act).reshape(r, t, heads * d)


def _stacks_block(op: Op, int8_products: Mapping[str, Affine]) -> int:
    """The block a ``moe``'s expert products round x to int8 by: its three stacks' (all in blocks, of one
    block size and without mins; the router's product is a linear one)."""
    codes = [int8_products.get(name) for name in op.inputs[2:5]]
    blocks = {c.block for c in codes if c is not None and c.mins is None}
    if len(blocks) != 1 or None in codes:
        raise LinnetError(f"int8 activations in a moe need its gate, up and down stacks in blocks of one size "
                          f"without mins (op {op})")
    return blocks.pop()


def moe(op: Op, act: type, x: np.ndarray, router: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
        *biases: np.ndarray, int8_block: int | None = None) -> np.ndarray:
    """Each token's top_k experts (ties: the lower index), their weights, and the weighted sum of their
    outputs, expert by expert in ascending order, each expert run once on the tokens that chose it. With
    ``int8_block`` (stacks in blocks under ``Program.int8_activations``), each expert product's x is
    first rounded to int8 per block of that size, as a linear op's."""
    def rounded(v: np.ndarray) -> np.ndarray:
        return v if int8_block is None else int8_rounded(v, int8_block)

    attrs = op.attrs
    router_bias = biases[0] if attrs.get("router_bias") else None
    expert_biases = biases[-3:] if attrs.get("expert_bias") else None
    tokens = x.reshape(-1, x.shape[-1])
    logits = linear(op, act, tokens, router, router_bias).astype(np.float32)
    k = attrs["top_k"]
    if attrs["gating"] == "softmax_topk":
        probs = _softmax(logits)
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(probs, chosen, axis=-1)
        if attrs.get("normalize"):
            weights = weights / weights.sum(axis=-1, keepdims=True)
    else:  # topk_softmax
        chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        weights = _softmax(np.take_along_axis(logits, chosen, axis=-1))
    weights = weights.astype(act)
    out = np.zeros_like(tokens)
    for e in np.unique(chosen):  # ascending
        rows, slots = np.nonzero(chosen == e)
        h = rounded(tokens[rows])
        b = (None, None, None) if expert_biases is None else tuple(bias[e] for bias in expert_biases)
        g, u = linear(op, act, h, gate[e], b[0]), linear(op, act, h, up[e], b[1])
        if attrs["activation"] == "swiglu":
            a = g / (1 + np.exp(-g)) * u
        else:  # clamped_swiglu
            alpha, limit = np.float32(attrs["alpha"]), np.float32(attrs["limit"])
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            a = g / (1 + np.exp(-alpha * g)) * (u + 1)
        out[rows] += linear(op, act, rounded(a), down[e], b[2]) * weights[rows, slots, None]
    return out.reshape(x.shape)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def rms_linear(op: Op, act: type, x: np.ndarray, w: np.ndarray, *rest: np.ndarray) -> np.ndarray:
    norm = rest[-1] if op.attrs.get("norm") else np.ones(x.shape[-1], dtype=act)
    bias = rest[:-1] if op.attrs.get("norm") else rest
    return linear(op, act, rms_norm(op, act, x, norm), w, *bias)


def split(op: Op, act: type, x: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(np.split(x, np.cumsum(op.attrs["sizes"])[:-1], axis=-1))


def activation(op: Op, act: type, x: np.ndarray) -> np.ndarray:
    fn = op.attrs["fn"]
    if fn == "silu":
        return x / (1 + np.exp(-x))
    if fn == "gelu":
        return (0.5 * x * (1 + _erf(x / np.sqrt(2.0)))).astype(x.dtype)
    inner = np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)
    return (0.5 * x * (1 + np.tanh(inner))).astype(x.dtype)


def _erf(x: np.ndarray) -> np.ndarray:
    from math import erf

    return np.vectorize(erf, otypes=[np.float64])(x.astype(np.float64))


def layer_norm(op: Op, act: type, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    x32 = x.astype(np.float32)
    centred = x32 - x32.mean(axis=-1, keepdims=True)
    scale = 1.0 / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + np.float32(op.attrs["eps"]))
    return (centred * scale * w.astype(np.float32) + b.astype(np.float32)).astype(DTYPES[op.attrs["dtype"]])


OPS: dict[str, Callable] = {
    "embedding": lambda op, act, tokens, table: table[tokens],
    "rms_norm": rms_norm,
    "linear": linear,
    "split": split,
    "split_heads": lambda op, act, x: x.reshape(*x.shape[:-1], op.attrs["heads"], -1),
    "rotary": rotary,
    "cache_write": cache_write,
    "attention": attention,
    "swiglu": lambda op, act, gate, up: gate / (1 + np.exp(-gate)) * up,
    "add": lambda op, act, a, b: a + b,
    "sub": lambda op, act, a, b: a - b,
    "mul": lambda op, act, a, b: a * b,
    "scale": lambda op, act, x: x * x.dtype.type(op.attrs["factor"]),
    "shift": lambda op, act, x: x + x.dtype.type(op.attrs["amount"]),
    "tanh": lambda op, act, x: np.tanh(x),
    "rsqrt": lambda op, act, x: 1 / np.sqrt(x),
    "mean": lambda op, act, x: x.mean(axis=-1, keepdims=True),
    "concat": lambda op, act, *xs: np.concatenate(xs, axis=-1),
    "activation": activation,
    "softcap": lambda op, act, x: np.tanh(x / x.dtype.type(op.attrs["cap"])) * x.dtype.type(op.attrs["cap"]),
    "layer_norm": layer_norm,
    "select": lambda op, act, x, select: np.take_along_axis(x, select[:, :, None], axis=1),
    "cast": lambda op, act, x: x.astype(DTYPES[op.attrs["dtype"]]),
    "norm_linear": lambda op, act, x, n, w, *b: linear(op, act, rms_norm(op, act, x, n), w, *b),
    "rms_linear": rms_linear,
    "moe": moe,
}

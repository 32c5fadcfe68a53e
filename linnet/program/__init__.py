"""The Linnet program: one model step as a pure function over typed, single-assignment values.

A backend is written from this docstring alone; ``linnet compile MODEL --target program`` prints a
model's program, and ``linnet.backends.reference`` executes it op by op as defined here.

The step
--------
    step(tokens, positions, rows, select, cache_k, cache_v, rope_cos, rope_sin, weights)
        -> logits, cache_k', cache_v'

Symbolic sizes: ``R`` batch entries, ``T`` tokens per entry, ``S`` selected tokens per entry, ``ROWS``
cache rows, ``P`` cache positions. Inputs:

    tokens     [R, T]   i64  token ids
    positions  [R, T]   i64  each token's position in its cache row, < P
    rows       [R]      i64  the cache row each entry reads and writes; distinct
    select     [R, S]   i64  indices into T: the tokens whose logits the step returns
    cache_k, cache_v    per layer [ROWS, KV_HEADS, P, HEAD_DIM] (a ring's: N + 1 slots, below), in the
               run dtype, or in the weights' where they are 16-bit under f32 arithmetic
               (``Program.cache_dtype``)
    rope_cos, rope_sin  [P, ROTARY_DIM * TABLES]  f32, from ``linnet.rope.rope_tables`` (scaling
               included); ROTARY_DIM is the head's width, or less for partial rotary. TABLES rotary tables
               side by side: table j is columns [j * ROTARY_DIM, (j + 1) * ROTARY_DIM). One table for most
               models; two where sliding layers rotate by a rope of their own (Gemma 3): the global rope's
               (table 0), then the local rope's (table 1)
    weights    ``w.<name>``, canonical names (``linnet.names``), in the weight dtype: the run dtype, or a
               narrower one (16-bit weights with f32 arithmetic, for CPUs, whose products are bound by
               the bytes they read); an op widens a weight to ``act`` where it reads it. A matrix named
               in ``Program.quantized`` is block-quantised instead (``linnet.quantize``): ``q8_0``,
               ``q4_0`` or ``q4_1``, llama.cpp's blocks of 32 along its in-axis, each an f16 scale d (and
               for q4_1 an f16 min m) and 32 codes q: w = d * q (q8_0, q int8), d * (q - 8) (q4_0,
               q in 0..15), d * q + m (q4_1); or ``q4_k`` / ``q6_k``, super-blocks of 256 whose
               sub-blocks are the same affine codes (``linnet.quantize.affine``); an op reads it as
               those values, in ``act``. With
               ``Program.int8_activations``, a linear op on such a matrix first rounds x to int8 per
               block of its scales (32; q6_k 16) with scale max|x| / 127, to nearest, as llama.cpp
               does, and multiplies the codes by those values; a block's min (q4_1, q4_k) multiplies
               the block's sum of x as it is. A moe's expert stacks [E, F, D] may be in blocks too (each
               expert's matrix cut along its in-axis), in the forms without mins; with int8 activations
               each expert product's x is rounded so first

and it computes

    x = embed(tokens)
    for i in range(LAYERS):  x, cache_k[i], cache_v[i] = kinds[layer_kinds[i]](x, cache_k[i], cache_v[i];
                                                                               w.layers.<i>.*)
    logits = head(x)                                     # [R, S, VOCAB] f32

``embed``, each layer kind's section (``kinds``: "full", "sliding", ...) and ``head`` are ``Section``s:
ops over named values, each value assigned once, with its shape and dtype (``infer_types``). A section
reads its parameters, the step's inputs, and weights; inside a layer, ``w.q`` means ``layers.<i>.q``.
A tied head's ``w.lm_head`` is ``w.embed``: a weight alias, nothing more. An architecture
(``linnet.arch``) builds the sections with ``linnet.program.builder``.

Ops (``act`` is the run dtype; ``x[..., F]`` means any leading axes). Their tiers, type rules and
decompositions are the op table, ``linnet.program.ops``; binary ops broadcast their second input over
the first's leading axes (a weight vector, a [..., 1] per-token value).
  embedding(tokens, table)              table[tokens], in act                    [R, T, H]
  rms_norm(x, w; eps)                   w * cast_act(x32 * rsqrt(mean(x32^2, -1) + eps)), x32 = f32(x);
                                        over the last axis (per head for q/k norm)
  linear(x, w[, b])                     x @ w.T (+ b), w [out, in]                 act
  split(x; sizes) -> (a, b, ...)        x cut along its last axis
  split_heads(x; heads)                 [..., heads * HEAD_DIM] -> [..., heads, HEAD_DIM]
  layer_norm(x, w, b; eps, dtype)       cast_act(((x32 - m) * rsqrt(mean((x32 - m)^2) + eps)) * f32(w) +
                                        f32(b)), m = mean(x32), x32 = f32(x), over the last axis
  rotary(x, positions, cos, sin[; table])
                                        x * c + rotate_half(x) * s, c = cast_act(cos[positions][..., j*D:
                                        (j+1)*D]) (same for s), rotate_half(x) = cat(-x[..., D/2:],
                                        x[..., :D/2]); D is x's width, each table's (the inputs' width is a
                                        multiple of D); j is ``table``, 0 when the attr is absent (partial
                                        rotary splits x, rotates the first part and concatenates)
  cache_write(cache, rows, positions, v[; ring, scratch])
                                        the cache with cache[rows[r], :, positions[r, t]] = v[r, t]
                                        rounded to the cache's dtype (a ring's: at the position's slot,
                                        below); when two entries write one place, which one lands is
                                        unspecified
  attention(q, cache_k, cache_v, rows, positions; scale[, softcap][, window[, ring]])
                                        for entry r, token t, head h: softmax over the visible p of
                                        s = q[r,t,h] . cache_k[rows[r], h // G, p] * scale, in f32 (with a
                                        softcap c, s = c * tanh(s / c) first), weighting
                                        cache_v[rows[r], h // G, p]; G = HEADS / KV_HEADS; heads merged:
                                        [R, T, HEADS * HEAD_DIM] act. Visible: p <= positions[r, t], and
                                        with a window W also p > positions[r, t] - W (W tokens, the
                                        query's own included; with ``ring``, the ring's slots, below).
                                        It reads the cache the step just wrote, so a token sees itself
                                        and the tokens before it. With ``sinks`` (attr sinks=True, a
                                        sixth input sinks [HEADS]): head h's softmax has one more logit,
                                        f32(sinks[h]) as it is, in its denominator only (it weighs no
                                        value; gpt-oss)
  swiglu(gate, up)                      silu(gate) * up
  activation(x; fn)                     silu(x) = x * sigmoid(x), gelu(x) = x * Phi(x) (erf), gelu_tanh(x)
                                        = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in act
  softcap(x; cap)                       cap * tanh(x / cap)
  add(a, b), sub(a, b), mul(a, b)       elementwise, b broadcast
  scale(x; factor), shift(x; amount)    x * factor, x + amount (the constant in x's dtype)
  tanh(x), rsqrt(x)                     elementwise
  mean(x)                               mean over the last axis, kept as an axis of 1
  concat(a, b, ...)                     along the last axis
  select(x, select)                     x[r, select[r, s]]                       [R, S, ...]
  cast(x; dtype)                        x in another dtype (the logits leave in f32)
  norm_linear(x, n, w[, b]; eps)        linear(rms_norm(x, n), w, b) as one op     (fuse_norm_linears)
  rms_linear(x, w[, b][, n]; eps)       norm_linear with n folded into w: w[:, j] * n[j] rounded once to act
                                        (fold_norm_weights); a tied head keeps n apart (its w is the embedding)
  moe(x, router, gate, up, down[, router_b][, gate_b, up_b, down_b]; top_k, gating[, normalize],
      activation[, alpha, limit][, router_bias][, expert_bias])
                                        a mixture of E experts of width F, per token of x [..., D]: router
                                        [E, D]; gate, up [E, F, D]; down [E, D, F]; then router_b [E]
                                        (with router_bias) and gate_b, up_b [E, F], down_b [E, D] (with
                                        expert_bias). l = f32(linear(x, router, router_b)). gating
                                        "softmax_topk": p = softmax(l), the top_k largest p, each weighing
                                        its p (with normalize, p / the top_k's sum); "topk_softmax": the
                                        top_k largest l, weighing softmax over those k. Equal scores rank
                                        the lower expert first. Weights w_e = cast_act(those). Expert e:
                                        g = linear(x, gate[e], gate_b[e]), u = linear(x, up[e], up_b[e]);
                                        "swiglu": a = silu(g) * u; "clamped_swiglu": g' = min(g, limit),
                                        u' = clamp(u, -limit, limit), a = g' * sigmoid(alpha g') * (u' + 1);
                                        y_e = linear(a, down[e], down_b[e]). Result: from zeros, + y_e * w_e
                                        for each chosen e in ascending order, in act. A kernel: an emitter
                                        reads the chosen experts' matrices only (there is no decomposition)

Cache positions a row has not written hold garbage; the mask (p <= the query's position) never reads
them. Runners keep one scratch position past the last real one, where idle rows and padding write.

Ring caches (``linnet.program.rings``, a pass runners apply): a layer kind whose attention has a window W
may keep a ring of N slots rather than every position. Its cache_k/cache_v are [ROWS, KV_HEADS, N + 1,
HEAD_DIM]; its cache_write carries ``ring=N, scratch=S`` and its attention ``ring=N``. Position p is
written at slot p mod N, the scratch position S at slot N, which no query sees. For a query at position
q, slot s < N holds the key age = (q - s) mod N positions back: visible where age < W and age <= q (the
window, and no position before 0). That is the full cache's step while a step writes at most N - W + 1
tokens of a row (no write then evicts a key its own queries read) and a row's positions are written in
order (a prefill that goes back, other than to position 0, goes back at most N - W + 1 positions once
the row held more than N).

Passes (``linnet.program.passes``) are opt-in and keep the step's meaning: fusions, folds, block
quantisation, and ``lower``, which replaces the composites an emitter has no native form for by their
decompositions.
"""
from linnet.program.builder import SectionBuilder, build_program
from linnet.program.ir import SIZES, Op, Program, Section, Shape, Value, layer_section_name, plan_section
from linnet.program.passes import (
    block_forms,
    fold_norm_weights,
    fuse_norm_linears,
    fuse_projections,
    infer_types,
    lower,
    quantize_weights,
)
from linnet.program.printer import format_program

__all__ = ["SIZES", "Op", "Program", "Section", "SectionBuilder", "Shape", "Value", "block_forms", "build_program",
           "fold_norm_weights", "format_program", "fuse_norm_linears", "fuse_projections", "infer_types",
           "layer_section_name", "lower", "plan_section", "quantize_weights"]

"""The functions a generated PyTorch step is made of (``codegen``), as real Python: linted and typed here.

``codegen`` copies parts of this file's text into each generated module, which must run with torch alone
(the file is a product a reader may take away): each part starts at a ``# part: NAME`` line and runs to
the next one; what comes before the first part (this docstring, the imports and the stand-ins below) is
never copied. A part may use the generated module's constants (the stand-ins) and the other parts'
names. The parts are not executed from here: importing this module defines them, nothing more (the
``linear`` part registers its custom op once per process, as any generated module would).
"""
import torch
import torch.nn.functional as F

# Stand-ins for the constants every generated module defines from its program.
HEADS, KV_HEADS, HEAD_DIM = 1, 1, 1


# part: norms
def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS(x) per token, in float32."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x.float() * rms_scale(x, eps)).to(x.dtype)


def compiled_decode(x: torch.Tensor) -> bool:
    """Whether x [R, T, ...] is a one-token step traced by torch.compile (the path written for inductor)."""
    return torch.compiler.is_compiling() and x.shape[1] == 1


# part: linear
# The 16-bit products this CPU runs natively (AVX512-BF16 or AMX; AMX-FP16). There a product of 16-bit
# weights under f32 arithmetic takes 16-bit inputs, sums in f32 and rounds its result to 16 bits, as a
# 16-bit GPU run does: several rows through oneDNN's 16-bit matrix product instead of widening the whole
# matrix at every call (16 rows of SmolLM2's head: 10 ms against 68), one row in its streaming loop with
# the same roundings, so that a row's result does not depend on the rows beside it.
NATIVE_16BIT = {torch.bfloat16: torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported(),
                torch.float16: torch.cpu._is_amx_fp16_supported()}


# torch's CPU build multiplies float32 matrices with MKL, whose kernels run at half speed on AMD CPUs (a
# 512-row product of Qwen2.5-0.5B's MLP: 157 GFLOP/s against oneDNN's 385 on an EPYC, 2 cores); oneDNN
# is as fast on Intel's. Compiled code calls oneDNN through this op as it is: inductor's own lowering of
# oneDNN's product takes constant weights only, and would re-lay them at compile time. oneDNN re-lays a
# plain weight at every call; a weight may carry a copy re-laid once as its attribute `onednn` (Linnet's
# runner adds them for steps of several rows), which the op, given the very tensor, uses. A 16-bit weight
# is widened into a buffer kept for the purpose: widened into fresh memory, the page faults cost 13
# times the conversion (16 against 1.2 ms for a 9728 x 896 matrix). The buffer stays as large as the
# largest matrix widened so far (a 16-bit head, for steps of several rows). A call takes it out while it
# uses it, so that a call on another thread makes its own rather than overwrite it.
if not hasattr(torch.ops.linnet, "matmul_t"):  # once per process, whichever generated module comes first
    _WIDE: dict[torch.dtype, torch.Tensor] = {}

    @torch.library.custom_op("linnet::matmul_t", mutates_args=())
    def _matmul_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if w.dtype == x.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, getattr(w, "onednn", w), None, "none", [], "")
        wide = _WIDE.pop(x.dtype, None)
        if wide is None or wide.numel() < w.numel():
            wide = torch.empty(w.numel(), dtype=x.dtype)
        try:
            return torch.ops.mkldnn._linear_pointwise(x, wide[:w.numel()].view(w.shape).copy_(w), None, "none", [], "")
        finally:
            _WIDE[x.dtype] = wide

    @_matmul_t.register_fake
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

ONEDNN = torch.backends.mkldnn.is_available()


def matmul_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] times w [out, in] transposed, in x's dtype (w widened to it)."""
    if w.is_mkldnn:  # re-laid for oneDNN at load (eager on a CPU)
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    if ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.ops.linnet.matmul_t(x, w)
    return x @ w.to(x.dtype).T


def linear(x: torch.Tensor, w: "torch.Tensor | Blocks", b: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, T, in] times w [out, in]. A compiled one-token step of one row streams w as a multiply-and-sum
    (a 16-bit w widened inside the loop); several rows take a matrix product, since that loop, laid out for
    one row, is bound by arithmetic at several (4 rows: 77 ms against 11 for one, SmolLM2 on 2 cores)."""
    if isinstance(w, Blocks):  # dequantised inside the product's loop for a decode step, whole for a prompt
        y = w.decode_product(x) if compiled_decode(x) else matmul_t(x, w.dequantize(x.dtype))
        return y if b is None else y + b
    one_row_decode = compiled_decode(x) and x.shape[0] == 1
    if w.dtype != x.dtype and NATIVE_16BIT[w.dtype]:  # 16-bit inputs and results, f32 sums
        x16 = x.to(w.dtype)
        y = (decode_product(x16, w, x.dtype).to(w.dtype) if one_row_decode else x16 @ w.T).to(x.dtype)
    else:
        y = decode_product(x, w) if one_row_decode else matmul_t(x, w)
    return y if b is None else y + b


# part: rms_linear
def rms_linear(
    x: torch.Tensor, eps: float, w: torch.Tensor, b: torch.Tensor | None = None, n: torch.Tensor | None = None
) -> torch.Tensor:
    """An RMS norm and the linear after it, the norm's weight folded into w's columns; or given apart as
    n, for a tied head, whose matrix is the embedding too."""
    scale = rms_scale(x, eps)
    if n is not None:
        x = n * x
    return linear((x.float() * scale).to(x.dtype), w, b)


def decode_product(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [R, 1, in] times w [out, in] as a multiply-and-sum in ``dtype`` (x's by default), for torch.compile.

    Decode reads every weight once per token. Inside the one compiled step, inductor's loop over
    [out, rows, in] streams the weights with no call, parallel region or barrier of its own; a BLAS
    matrix-vector product reached half the memory bandwidth on an AMD EPYC, and on an Intel Xeon the
    step with MKL's products was no faster. Sums longer than 4096 are split into equal parts, since
    inductor accumulates longer ones through a slower cascade. A 16-bit weight is widened inside the
    loop, so the loop streams half the bytes; so is a 16-bit x (bf16 times bf16: a CPU's bf16 dot product,
    see decode_compile).
    """
    size, dtype = w.shape[1], dtype or x.dtype
    parts = next(p for p in range(-(-size // 4096), size + 1) if size % p == 0)
    products = w.view(-1, 1, parts, size // parts).to(dtype) * x[:, 0].view(1, -1, parts, size // parts).to(dtype)
    return products.sum(-1).sum(-1).T[:, None]


# part: blocks
class Blocks(torch.nn.Module):
    """A matrix [out, in] in llama.cpp's blocks of 32 along `in`, given as the bytes a GGUF file holds:
    per block an f16 scale d (q4_1: then an f16 min m), then 32 codes q. q8_0: q int8, w = d * q; q4_0
    and q4_1: two codes a byte (element j in the low nibble, j + 16 in the high), w = d * (q - 8) and
    w = d * q + m. `scales`, `mins` and `codes` are views of those bytes, not copies. A stack of such
    matrices (a mixture's experts, [experts, out, in]) is one Blocks too, its experts read by index. A
    K-quant's super-blocks of 256 (q4_k, q6_k: `super_blocks`) are kept whole as `codes` and only
    dequantised, a stack's chosen experts at a time (eager's experts)."""

    BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q6_k": 210}
    SUPER_BLOCKS = ("q4_k", "q6_k")  # kept whole, dequantised only
    scales: torch.Tensor
    mins: torch.Tensor
    codes: torch.Tensor

    def __init__(self, form: str, data: torch.Tensor):
        super().__init__()
        self.form = form
        blocks = data.view(*data.shape[:-1], -1, self.BYTES[form])  # [(experts,) out, in / 32, bytes]
        if form in self.SUPER_BLOCKS:  # [(experts,) out, in / 256, bytes]
            self.register_buffer("codes", blocks, persistent=False)
            return
        self.register_buffer("scales", blocks[..., :2].view(torch.float16), persistent=False)  # [..., in / 32, 1]
        if form == "q4_1":
            self.register_buffer("mins", blocks[..., 2:4].view(torch.float16), persistent=False)
        codes = blocks[..., 4 if form == "q4_1" else 2:]
        self.register_buffer("codes", codes.view(torch.int8) if form == "q8_0" else codes, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self, dtype: torch.dtype, rows: "torch.Tensor | int | None" = None) -> torch.Tensor:
        """The matrix, or its `rows` (an embedding's lookup; a stack's experts), in dtype."""
        if self.form in self.SUPER_BLOCKS:
            return super_blocks(self.form, self.codes if rows is None else self.codes[rows]).flatten(-2).to(dtype)
        codes, d = self.codes, self.scales
        m = self.mins if self.form == "q4_1" else None
        if rows is not None:  # indexed before widening: a stack's other experts are not read
            codes, d, m = codes[rows], d[rows], None if m is None else m[rows]
        d = d.float()
        if self.form == "q8_0":
            w = codes.float() * d
        else:
            q = torch.cat((codes & 15, codes >> 4), -1).float()
            w = q * d + m.float() if m is not None else (q - 8) * d
        return w.flatten(-2).to(dtype)

    def decode_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, 1, in] times the matrix as a multiply-and-sum, each weight dequantised where the loop
        reads it (see decode_product): the loop streams the blocks' bytes."""
        rows = x.shape[0]
        d, codes = self.scales.float().unsqueeze(1), self.codes.unsqueeze(1)  # [out, 1, in / 32, ...]
        if self.form == "q8_0":
            products = codes.float() * d * x[:, 0].view(1, rows, -1, 32)
        else:
            x = x[:, 0].view(1, rows, -1, 2, 16)  # each block's elements j and j + 16
            m = self.mins.float().unsqueeze(1) if self.form == "q4_1" else -8 * d
            products = ((codes & 15).float() * d + m) * x[..., 0, :] + ((codes >> 4).float() * d + m) * x[..., 1, :]
        return products.sum((-2, -1)).T[:, None]


def super_blocks(form: str, raw: torch.Tensor) -> torch.Tensor:
    """A K-quant's super-blocks of bytes [..., n, 144 | 210] as the 256 values each stands for [..., n, 256],
    in float32, computed as gguf.quants computes them. q4_k: f16 d and dmin, twelve bytes packing eight
    6-bit scales sc and mins m, then eight sub-blocks of 32 4-bit codes (each 32 bytes hold two: low
    nibbles, then high), w = d * sc * q - dmin * m. q6_k: 128 bytes of low 4 bits, 64 of high 2 bits, sixteen
    int8 scales, f16 d; w = d * sc * (q - 32) in sub-blocks of 16."""
    def f16(at: int) -> torch.Tensor:  # the f16 at byte `at` of each super-block, as float32 [..., n, 1]
        return raw[..., at:at + 2].contiguous().view(torch.float16).float()

    if form == "q4_k":
        packed = raw[..., 4:16]
        low, high, tail = packed[..., :4], packed[..., 4:8], packed[..., 8:]
        sc = torch.cat((low & 63, (tail & 15) | ((low >> 6) << 4)), -1).float()  # [..., n, 8]
        m = torch.cat((high & 63, (tail >> 4) | ((high >> 6) << 4)), -1).float()
        qs = raw[..., 16:].unflatten(-1, (4, 32))
        q = torch.stack((qs & 15, qs >> 4), -2).flatten(-3, -2).float()  # [..., n, 8, 32]
        return ((f16(0) * sc)[..., None] * q - (f16(2) * m)[..., None]).flatten(-2)
    ql, qh = raw[..., :128].unflatten(-1, (2, 64)), raw[..., 128:192].unflatten(-1, (2, 32))
    sc = raw[..., 192:208].view(torch.int8).float()  # [..., n, 16]
    low = torch.stack((ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4), -2)
    high = torch.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], -2)  # [..., n, 2, 4, 32] both
    q = (low | (high << 4)).flatten(-3).float() - 32  # [..., n, 256]
    return ((f16(208) * sc)[..., None] * q.unflatten(-1, (16, 16))).flatten(-2)


def attach(module: torch.nn.Module, name: str, weight: "torch.Tensor | Blocks") -> None:
    if isinstance(weight, Blocks):
        module.add_module(name, weight)
    else:
        module.register_buffer(name, weight, persistent=False)


# part: layer_norm
def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """LayerNorm over the last axis in float32, rounded once to dtype."""
    return F.layer_norm(x.float(), x.shape[-1:], w.float(), b.float(), eps).to(dtype)


# part: moe
def moe(x: torch.Tensor, router: torch.Tensor, gate: "torch.Tensor | Blocks", up: "torch.Tensor | Blocks",
        down: "torch.Tensor | Blocks", *biases: torch.Tensor, top_k: int, gating: str, activation: str,
        normalize: bool = False, alpha: float | None = None, limit: float | None = None, router_bias: bool = False,
        expert_bias: bool = False) -> torch.Tensor:
    """A mixture of experts on x [R, T, D]: router [E, D]; each expert's gate and up [E, F, D] and down
    [E, D, F]; after them the router's bias, then the experts' gate, up and down biases, as the flags say.
    Each token picks its top_k experts (equal scores: the lower index first, as a stable sort ranks them):
    by a softmax over every expert's logit ("softmax_topk", with normalize the picks' weights divided by
    their sum), or by logit, weighted by a softmax over the picks' ("topk_softmax"). Tokens are grouped
    by expert: an expert some token chose reads its matrices once, for those tokens; the others are
    never read. Its output times the token's weight for it is added expert by expert, in index order.
    A compiled step cannot loop over data (torch.export does not trace it): there each token's experts'
    matrices are gathered (`gathered_experts`), which reads the chosen ones alone."""
    r_bias = biases[0] if router_bias else None
    g_bias, u_bias, d_bias = biases[-3:] if expert_bias else (None, None, None)
    tokens = x.flatten(0, 1)
    logits = linear(x, router, r_bias).float().flatten(0, 1)
    scores = logits.softmax(-1) if gating == "softmax_topk" else logits
    ranked, order = scores.sort(dim=-1, descending=True, stable=True)
    weights, chosen = ranked[:, :top_k], order[:, :top_k]
    if gating == "topk_softmax":
        weights = weights.softmax(-1)
    elif normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(x.dtype)

    def activate(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if activation == "swiglu":
            return F.silu(g) * u
        assert alpha is not None and limit is not None  # clamped_swiglu has both
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)  # clamped_swiglu: the gate above, up on both sides
        return g * torch.sigmoid(alpha * g) * (u + 1)

    if torch.compiler.is_compiling():
        out = gathered_experts(tokens, chosen, weights, gate, up, down, g_bias, u_bias, d_bias, activate)
        return out.view_as(x)
    out = torch.zeros_like(tokens)
    for e in chosen.unique().tolist():  # the experts chosen, in ascending order
        token, slot = (chosen == e).nonzero(as_tuple=True)
        h = tokens[token][None]
        g = linear(h, expert(gate, e, h.dtype), None if g_bias is None else g_bias[e])
        u = linear(h, expert(up, e, h.dtype), None if u_bias is None else u_bias[e])
        y = linear(activate(g, u), expert(down, e, h.dtype), None if d_bias is None else d_bias[e])[0]
        out.index_add_(0, token, y * weights[token, slot][:, None])
    return out.view_as(x)


def expert(stack: "torch.Tensor | Blocks", chosen: "torch.Tensor | int", dtype: torch.dtype) -> torch.Tensor:
    """The matrices of the ``chosen`` experts of a stack: a float one as it is stored; one in blocks
    (eager only: see ``TorchRunner``) dequantised, those experts' bytes alone read. (A module without
    matrices in blocks defines no class for them: the test is on the tensor.)"""
    if isinstance(stack, torch.Tensor):
        return stack[chosen]
    return stack.dequantize(dtype, chosen)


def gathered_experts(tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                     gate: "torch.Tensor | Blocks", up: "torch.Tensor | Blocks", down: "torch.Tensor | Blocks",
                     g_bias: torch.Tensor | None, u_bias: torch.Tensor | None, d_bias: torch.Tensor | None,
                     activate) -> torch.Tensor:
    """The experts of a compiled step, tokens [N, D] with their picks chosen and weights [N, top_k]: each
    token's experts' matrices gathered (stack[chosen]) into sums of products, which inductor computes in
    loops that read the chosen experts' rows where they lie, and no other expert's (Linnet's runner
    compiles its one-token decode step so; a prompt's tokens run eager, grouped by expert). Each token's
    outputs are added in ascending order of expert."""
    chosen, slot = chosen.sort(-1)
    weights = weights.gather(-1, slot)
    h = tokens[:, None, None]  # [N, 1, 1, D]
    g, u = ((expert(stack, chosen, h.dtype).to(h.dtype) * h).sum(-1) for stack in (gate, up))  # [N, top_k, F]
    if g_bias is not None and u_bias is not None:
        g, u = g + g_bias[chosen], u + u_bias[chosen]
    y = (expert(down, chosen, h.dtype).to(h.dtype) * activate(g, u)[:, :, None]).sum(-1)  # [N, top_k, D]
    if d_bias is not None:
        y = y + d_bias[chosen]
    y = y * weights[..., None]
    out = torch.zeros_like(tokens)
    for j in range(chosen.shape[1]):
        out = out + y[:, j]
    return out


# part: rings
def ring_slots(positions: torch.Tensor, slots: int, scratch: int) -> torch.Tensor:
    """Where each position is written in a ring cache of `slots`: p mod slots; the scratch position in the
    slot after them."""
    return torch.where(positions == scratch, slots, positions % slots)


def ring_mask(positions: torch.Tensor, slots: int, window: int) -> torch.Tensor:
    """[R, 1, T, slots]: the slots of a ring cache each query sees. Slot s holds the key (q - s) mod slots
    positions before the query's q: seen within the window, and where that is no earlier than position 0."""
    age = (positions[..., None] - torch.arange(slots, device=positions.device)) % slots
    return ((age < window) & (age <= positions[..., None]))[:, None]


# part: ops
def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, HEAD_DIM))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) being (-x2, x1), over x's width (the tables'). The
    halves are swapped by a flip, which inductor folds into the loops that read x; a torch.cat would be
    copies of their own, each a single-threaded pass and a barrier in the compiled step."""
    sign = torch.tensor([-1.0, 1.0], dtype=x.dtype, device=x.device)[:, None]
    rotated = (x.unflatten(-1, (2, -1)).flip(-2) * sign).flatten(-2)
    return x * cos + rotated * sin


def cache_write(cache: torch.Tensor, rows: torch.Tensor | slice, positions: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
    """value [R, T, KV_HEADS, D] written at (rows, positions), in place, rounded to the cache's dtype."""
    value = value.to(cache.dtype)
    if isinstance(rows, slice):  # consecutive rows: write through their view
        cache[rows][torch.arange(value.shape[0], device=value.device)[:, None], :, positions] = value
    else:
        cache[rows[:, None], :, positions] = value
    return cache


def row_window(rows: torch.Tensor) -> torch.Tensor | slice:
    """rows [R] as a slice where they are consecutive, as the serving engine's steps mostly are: their
    cache is then read as a view rather than copied, which is most of an eager decode step's attention."""
    first = int(rows[0])
    consecutive = torch.equal(rows, torch.arange(first, first + rows.shape[0], device=rows.device))
    return slice(first, first + rows.shape[0]) if consecutive else rows


def attention(q, cache_k, cache_v, rows, mask, scale: float, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [R, T, HEADS, D] against the rows' cache up to mask's length: mask [R, 1, T, keys] (causal, and
    windowed for a sliding layer). Scores are q . k * scale, with a softcap c then c * tanh(scores / c);
    sinks [HEADS], a logit per head in the softmax's denominator that weighs no value."""
    span = mask.shape[-1]
    if torch.compiler.is_compiling():  # an exported step's span is symbolic: gathered (and fused into the
        within = torch.arange(span, device=q.device)  # loops that read it), as a view it would be fixed
        keys, values = cache_k[rows].index_select(2, within), cache_v[rows].index_select(2, within)
    else:
        keys, values = cache_k[rows, :, :span], cache_v[rows, :, :span]
    if compiled_decode(q):  # a narrower cache is widened inside its loops
        return decode_attention(q, keys, values, mask, scale, softcap, sinks)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a 16-bit cache under f32 arithmetic, widened
    if q.shape[1] == 1 and sinks is None:  # one query a row: a key head's group of query heads, one product's rows
        groups = HEADS // KV_HEADS
        scores = capped((q.view(q.shape[0], KV_HEADS, groups, HEAD_DIM) * scale) @ keys.transpose(-1, -2), softcap)
        scores = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        return (scores @ values).view(q.shape[0], 1, HEADS * HEAD_DIM)
    if softcap is not None or sinks is not None:  # which SDPA has not: the scores in full, each key head
        keys, values = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (keys, values))  # repeated
        scores = capped((q.transpose(1, 2) * scale) @ keys.transpose(-1, -2), softcap)
        scores = softmax(scores.masked_fill(~mask, float("-inf")), sinks, (1, HEADS, 1, 1)).to(q.dtype)
        return (scores @ values).transpose(1, 2).flatten(2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2).flatten(2)


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """c * tanh(scores / c) in float32, for a softcap c."""
    return scores if softcap is None else softcap * torch.tanh(scores.float() / softcap)


def softmax(scores: torch.Tensor, sinks: torch.Tensor | None, heads: tuple[int, ...]) -> torch.Tensor:
    """The softmax of scores over their last axis, in float32; with sinks, each head's (viewed as
    ``heads``, to broadcast over scores) in the denominator as one more logit, which weighs no value."""
    if sinks is None:
        return scores.softmax(-1, dtype=torch.float32)
    sink = sinks.float().view(heads).expand(*scores.shape[:-1], 1)
    return torch.cat((scores.float(), sink), -1).softmax(-1)[..., :-1]


def decode_attention(q, keys, values, mask, scale: float, softcap: float | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row as sums of products, which inductor fuses with the cache reads (no copies)."""
    rows, groups = q.shape[0], HEADS // KV_HEADS
    q = q.view(rows, KV_HEADS, groups, 1, HEAD_DIM) * scale
    scores = capped((q * keys[:, :, None]).sum(-1), softcap)  # [R, KV_HEADS, groups, positions]
    scores = softmax(scores.masked_fill(~mask[:, :, 0, None], float("-inf")), sinks, (1, KV_HEADS, groups, 1))
    out = (scores[..., None] * values[:, :, None].float()).sum(-2)  # [R, KV_HEADS, groups, HEAD_DIM]
    return out.to(q.dtype).view(rows, 1, HEADS * HEAD_DIM)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def embedding(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[tokens]


def select_tokens(x: torch.Tensor, select: torch.Tensor | None) -> torch.Tensor:
    """x[r, select[r, s]]: the tokens whose logits are wanted; None keeps every token."""
    return x if select is None else x[torch.arange(x.shape[0], device=x.device)[:, None], select]

"""The decode step's compile: each product's input realized before the product, guided loop schedules,
streamed weights prefetched in AVX2 code, bf16 dot products; other compiles keep inductor's defaults."""
from __future__ import annotations

import re
import zipfile

import pytest
import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from linnet.backends import CacheShape, create_runner
from linnet.backends.torch import aot, decode_compile
from linnet.backends.torch.decode_compile import PREFETCH_BYTES, decode_compile_options, product_inputs
from linnet.model import open_model


@pytest.fixture
def two_threads_no_graph_cache():
    """Two threads, so that inductor writes parallel loops; no on-disk graph cache, so that code is
    generated here rather than read back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield
    torch.set_num_threads(threads)


def scaled_product(x, w, n):
    """A tied head's shape of work: x scaled per token and by n, then a multiply-and-sum with w."""
    xs = n * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    return (w * xs).sum(-1)


def test_the_pass_finds_the_activation_a_weight_product_reads():
    x, w, n = torch.randn(1, 64), torch.randn(512, 64), torch.randn(64)
    graph = make_fx(scaled_product)(x, w, n).graph
    [activation] = product_inputs(graph)
    assert activation.op == "call_function" and activation.target == torch.ops.aten.mul.Tensor
    assert activation is graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)[-2]
    # a product of two activations (attention's scores) reads no weight: nothing to realize
    assert product_inputs(make_fx(lambda q, k: (q.exp() * k.exp()).sum(-1))(x, w).graph) == []


def scores(x, w, cos, sin, cache, rows, within):
    """Attention's scores in a decode step's shape of work: a query projected from x, rotated and scaled
    (pointwise, in the step), times the keys gathered from the cache's rows and positions."""
    q = (x[:, None] * w).sum(-1).view(1, 4, 64)  # [R, HEADS, D]
    q = q * cos + torch.cat((-q[..., 32:], q[..., :32]), -1) * sin
    keys = cache[rows].index_select(2, within)  # [R, HEADS, P, D]
    return ((q * 0.125)[:, :, None] * keys).sum(-1)


SCORES_ARGS = (0.1 * torch.randn(1, 64), torch.randn(256, 64), torch.randn(64), torch.randn(64),
               torch.randn(2, 4, 4096, 64), torch.tensor([1]), torch.arange(4096))


def test_the_pass_finds_the_query_a_product_with_the_cache_reads():
    graph = make_fx(scores)(*SCORES_ARGS).graph
    [query] = product_inputs(graph)  # not x, a graph input as it is
    assert query.target == torch.ops.aten.mul.Tensor and query.args[1] == 0.125  # the scaled query, not the keys


def test_the_scores_loop_reads_the_keys_and_a_realized_query(two_threads_no_graph_cache):
    """Without the pass the query's rotation and scale are redone inside the loop over the cache's 4096
    positions (Phi's were, for every position of every head: a third of its decode step at 1,024)."""
    plain = torch.compile(scores, options={"realize_reads_threshold": 1})
    lean = torch.compile(scores, options=decode_compile_options())
    _, [plain_code] = run_and_get_code(plain, *SCORES_ARGS)
    out, [lean_code] = run_and_get_code(lean, *SCORES_ARGS)
    torch.testing.assert_close(out, scores(*SCORES_ARGS), rtol=1e-4, atol=1e-4)
    assert "0.125" in _loop_over(plain_code, 4096) and "0.125" not in _loop_over(lean_code, 4096)


def _loop_over(code: str, size: int) -> str:
    """The C++ of the first loop over ``size`` iterations, to the end of its body."""
    start = re.search(rf"x\d+<static_cast<int64_t>\({size}L\)", code).start()
    return code[start:code.index("}\n        }\n", start)]


def test_a_weight_the_graph_holds_as_a_constant_is_a_weight():
    """An exported step's weights are constants of its graph (`get_attr`), not inputs: the pass found no
    product in AOTInductor packages until it knew them (SmolLM2's decode step 15-26% slower)."""
    x, w, n = torch.randn(1, 64), torch.randn(512, 64), torch.randn(64)
    graph = make_fx(lambda x, n: scaled_product(x, w, n))(x, n).graph
    assert graph.find_nodes(op="get_attr")
    [activation] = product_inputs(graph)
    assert activation.target == torch.ops.aten.mul.Tensor


def test_the_product_loop_reads_only_the_weights_and_a_realized_input(two_threads_no_graph_cache):
    x, w, n = torch.randn(1, 64), torch.randn(4096, 64), torch.randn(64)
    plain = torch.compile(scaled_product, options={"realize_reads_threshold": 1})
    lean = torch.compile(scaled_product, options=decode_compile_options())
    _, [plain_code] = run_and_get_code(plain, x, w, n)
    out, [lean_code] = run_and_get_code(lean, x, w, n)
    torch.testing.assert_close(out, scaled_product(x, w, n))
    # without the pass, the scaling (a square root) is redone inside the loop over w's 4096 rows
    assert plain_code.count("std::sqrt") == 1 and "std::sqrt" in _reduction_over_rows(plain_code)
    assert "std::sqrt" not in _reduction_over_rows(lean_code)


def _reduction_over_rows(code: str) -> str:
    """The C++ of the loop over w's 4096 rows."""
    start = code.index("x0<static_cast<int64_t>(4096L)")
    return code[start:code.index("}\n        }\n", start)]


def test_only_compiles_given_the_options_get_guided_loops(two_threads_no_graph_cache):
    x, w = torch.randn(64), torch.randn(4096, 64)
    guided = torch.compile(lambda x, w: (w * x).sum(-1).relu(), options=decode_compile_options())
    plain = torch.compile(lambda x, w: (w * x).sum(-1).relu())
    out, [guided_code] = run_and_get_code(guided, x, w)
    _, [plain_code] = run_and_get_code(plain, x, w)
    assert "#pragma omp for schedule(guided)" in guided_code
    assert "#pragma omp for" in plain_code and "schedule(guided)" not in plain_code
    torch.testing.assert_close(out, (w * x).sum(-1).relu())


AVX2 = {"cpp.simdlen": 256}  # inductor's code for 256-bit vectors, on any x86-64 CPU this project runs on


def test_only_compiles_given_the_options_prefetch_the_streamed_weights(two_threads_no_graph_cache):
    """In AVX2 code, a floating-point weight larger than the L2 cache is prefetched ahead of the product's
    loads; a small input (x, which stays in L1) is not, and nor is anything in a compile without the
    options, nor code for 512-bit vectors."""
    x, w = torch.randn(1, 1, 1024), torch.randn(4096, 1024).to(torch.bfloat16)  # w: 8 MiB

    def product(x, w):
        return (w.view(-1, 1, 1024).float() * x[:, 0].view(1, -1, 1024)).sum(-1).relu()

    with torch._inductor.config.patch(AVX2):
        out, [lean] = run_and_get_code(torch.compile(product, options=decode_compile_options()), x, w)
        _, [plain] = run_and_get_code(torch.compile(product), x, w)
    torch.testing.assert_close(out, product(x, w), rtol=1e-4, atol=1e-4)  # sums in another order
    loop = _reduction_over_rows(lean)
    [prefetch] = re.findall(r"__builtin_prefetch\((\w+) \+ (.*) \+ (\d+)\);", loop)
    [weight_load] = re.findall(r"Vectorized<at::BFloat16>::loadu\((\w+) \+ (.*), static_cast", loop)
    assert prefetch[:2] == weight_load  # the weight's stream, ...
    assert int(prefetch[2]) * 2 == PREFETCH_BYTES  # ... so many bytes ahead
    assert "__builtin_prefetch" not in plain
    # integer codes (a matrix in blocks) are read by loops bound by their arithmetic: not prefetched
    codes = torch.randint(-127, 128, (4096, 1024), dtype=torch.int8)
    with torch._inductor.config.patch(AVX2):
        _, [integer] = run_and_get_code(torch.compile(product, options=decode_compile_options()), x, codes)
    assert "Vectorized<int8_t>::loadu" in _reduction_over_rows(integer) and "__builtin_prefetch" not in integer
    if pick_vec_isa().bit_width() == 512:  # the prefetches slowed an AVX-512 EPYC's loops: none there
        _, [wide] = run_and_get_code(torch.compile(product, options=decode_compile_options()), x, w)
        assert "Vectorized<at::BFloat16>::loadu" in _reduction_over_rows(wide) and "__builtin_prefetch" not in wide


def test_a_loop_over_a_kernels_own_local_buffer_compiles(two_threads_no_graph_cache):
    """A softmax's row kept in a per-thread local buffer (outer-loop fusion) is no buffer of the graph's,
    so it has no size to look up for a prefetch (Qwen2.5-0.5B's prompt step failed to compile on it)."""
    x = torch.randn(8, 32, 1, 4096)

    def scaled_softmax(x):
        return (x * 0.1).softmax(-1) * 2

    out, [code] = run_and_get_code(torch.compile(scaled_softmax, options=decode_compile_options()), x)
    assert "local_buffer" in code
    torch.testing.assert_close(out, scaled_softmax(x))


def test_the_decode_step_is_compiled_with_guided_loops_and_prefetches(checkpoint_dir, two_threads_no_graph_cache,
                                                                      monkeypatch, tmp_path):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path))  # a package compiled here, not found on disk
    monkeypatch.setattr(decode_compile, "STREAMED_BYTES", 1024)
    with torch._inductor.config.patch(AVX2):  # code for 256-bit vectors, where the prefetches are
        runner = create_runner("torch:inductor", open_model(str(checkpoint_dir("qwen2-tied"))).weights,
                               CacheShape(rows=2, positions=32))
        runner.prefill(0, list(range(3, 10)))
        runner.decode([5, 0])
        one = torch.zeros((2, 1), dtype=torch.int64)  # the package's key holds the vector width asked for
        package = aot.package_path(runner.model, runner.source, (one, one, one[:, 0], None), dynamic=False)
    with zipfile.ZipFile(package) as files:
        [decode_code] = [files.read(n).decode() for n in files.namelist() if n.endswith(".kernel.cpp")]
    assert decode_code.count("#pragma omp for schedule(guided)") > 0
    assert "__builtin_prefetch" in decode_code  # the tiny model's matrices, streamed past 1 KiB
    # what stays static is a parallel reduction's loop (each thread sums into its own _local accumulator)
    for static in re.finditer(r"#pragma omp for\n", decode_code):
        region = decode_code[decode_code.rindex("#pragma omp parallel", 0, static.start()):static.start()]
        assert "_local = " in region


def test_a_product_input_from_a_python_function_is_left_alone():
    """operator.getitem (a split's part) has no op tags: not a pointwise op the pass realizes."""
    x, w = torch.randn(1, 128), torch.randn(512, 64)
    graph = make_fx(lambda x, w: (w * x.split(64, -1)[1]).sum(-1))(x, w).graph
    assert product_inputs(graph) == []


def test_a_16_bit_weight_widened_in_the_loop_is_still_a_weight(two_threads_no_graph_cache):
    x, n = torch.randn(1, 64), torch.randn(64)
    w = torch.randn(4096, 64).to(torch.bfloat16)

    def widened(x, w, n):
        return scaled_product(x, w.to(torch.float32), n)

    assert len(product_inputs(make_fx(widened)(x, w, n).graph)) == 1
    out, [code] = run_and_get_code(torch.compile(widened, options=decode_compile_options()), x, w, n)
    torch.testing.assert_close(out, widened(x, w, n))
    loop = _reduction_over_rows(code)
    assert "std::sqrt" not in loop and "convert<float,2,at::BFloat16" in loop  # reads 16 bits, widens in the loop


def rounded(x, w, n):
    """The generated `linear` on a CPU with 16-bit products: the input rounded to bf16, then it and the
    bf16 weights widened to f32 and multiplied, summed in f32."""
    xs = n * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    return (w.float() * xs.to(torch.bfloat16).float()).sum(-1)


ROUNDED_ARGS = (torch.randn(1, 64), torch.randn(4096, 64).to(torch.bfloat16), torch.randn(64))


def test_a_16_bit_rounded_input_is_rounded_once_not_in_the_loop(two_threads_no_graph_cache):
    """The rounded input is what the pass realizes, in bf16, so that the loop over the weights reads two
    bf16 streams and rounds nothing again for every weight row. In AVX2 code both are widened there."""
    with torch._inductor.config.patch(AVX2):
        out, [code] = run_and_get_code(torch.compile(rounded, options=decode_compile_options()), *ROUNDED_ARGS)
    torch.testing.assert_close(out, rounded(*ROUNDED_ARGS))
    loop = _reduction_over_rows(code)
    assert loop.count("Vectorized<at::BFloat16>::loadu") == 2  # the weights and the realized input
    assert loop.count("convert<float,2,at::BFloat16") == 2  # each widened
    assert "convert<at::BFloat16" not in loop and "convert<at::BFloat16" in code  # rounded, once, before
    assert "dpbf16" not in code


@pytest.mark.skipif(not (pick_vec_isa().bit_width() == 512 and torch.cpu._is_avx512_bf16_supported()),
                    reason="needs a CPU with AVX512-BF16 dot products")
def test_a_bf16_product_is_a_bf16_dot_product_where_the_cpu_has_one(two_threads_no_graph_cache):
    """bf16 weights times a bf16 input, summed along the vector axis: one vdpbf16ps a 32 values, in f32."""
    out, [code] = run_and_get_code(torch.compile(rounded, options=decode_compile_options()), *ROUNDED_ARGS)
    torch.testing.assert_close(out, rounded(*ROUNDED_ARGS), rtol=1e-5, atol=1e-5)  # sums in another order
    loop = _reduction_over_rows(code)
    assert loop.count("_mm512_dpbf16_ps") == 1 and "tmp_acc0_vec + " not in loop
    # an f32 input (not rounded to bf16) stays a widened multiply-and-add: bf16 products would round it
    x, w, n = ROUNDED_ARGS
    _, [widened] = run_and_get_code(torch.compile(scaled_product, options=decode_compile_options()), x, w.float(), n)
    assert "dpbf16" not in widened
    # nor does a compile without the options change
    _, [plain] = run_and_get_code(torch.compile(rounded), *ROUNDED_ARGS)
    assert "dpbf16" not in plain


@pytest.mark.parametrize("form, code", [("q8_0", "Vectorized<int8_t>::loadu"), ("q4_1", "Vectorized<uint8_t>::loadu")])
def test_a_matrix_in_blocks_is_dequantised_in_the_loop(form, code, two_threads_no_graph_cache):
    """The generated `Blocks` product: the loop reads the block bytes (8-bit codes, f16 scales) and the
    realized input, nothing recomputed per weight."""
    from linnet.backends.torch.codegen import generate_source
    from linnet.backends.torch.runner import load_generated_module, torch_program
    from linnet.quantize import dequantized, quantized
    from linnet.spec import spec_from_hf_config

    spec = spec_from_hf_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 64,
                                "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 1e4})
    blocks_class = load_generated_module(generate_source(torch_program(spec, quantize=form))).Blocks
    matrix = torch.randn(4096, 64).numpy()
    w = blocks_class(form, torch.from_numpy(quantized(matrix, form)))
    x, n = torch.randn(1, 1, 64), torch.randn(64)

    def scaled(x, n):
        return n * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))

    def product(x, n):
        return w.decode_product(scaled(x, n))

    _, [plain] = run_and_get_code(torch.compile(product, options={"realize_reads_threshold": 1}), x, n)
    out, [lean] = run_and_get_code(torch.compile(product, options=decode_compile_options()), x, n)
    values = torch.from_numpy(dequantized(quantized(matrix, form), form))
    torch.testing.assert_close(out[0, 0], values @ scaled(x, n)[0, 0], rtol=1e-4, atol=1e-4)
    # the loop reads 8-bit codes and widens them; the pass (which sees the dequantised blocks as a
    # weight) has the scaled input written once before it, where it would be recomputed per row
    assert code in _reduction_over_rows(lean) and "std::sqrt" not in _reduction_over_rows(lean)
    if form == "q8_0":  # (a 4-bit block reads the input twice, its halves, which realizes it anyway)
        assert "std::sqrt" in _reduction_over_rows(plain)

"""The compiled decode step's parallel loops are scheduled guided; other compiles keep inductor's default."""
from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from linnet.backends import CacheShape, create_runner
from linnet.backends.torch.loop_schedule import guided_loop_options
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


def test_only_compiles_given_the_options_get_guided_loops(two_threads_no_graph_cache):
    x, w = torch.randn(64), torch.randn(4096, 64)
    guided = torch.compile(lambda x, w: (w * x).sum(-1).relu(), options=guided_loop_options())
    plain = torch.compile(lambda x, w: (w * x).sum(-1).relu())
    out, [guided_code] = run_and_get_code(guided, x, w)
    _, [plain_code] = run_and_get_code(plain, x, w)
    assert "#pragma omp for schedule(guided)" in guided_code
    assert "#pragma omp for" in plain_code and "schedule(guided)" not in plain_code
    torch.testing.assert_close(out, (w * x).sum(-1).relu())


def test_the_decode_step_is_compiled_with_guided_loops(checkpoint_dir, two_threads_no_graph_cache):
    runner = create_runner("torch:inductor", open_model(str(checkpoint_dir("qwen2-tied"))).weights,
                           CacheShape(rows=2, positions=32))
    runner.prefill(0, list(range(3, 10)))
    _, codes = run_and_get_code(runner.decode, [5, 0])
    [decode_code] = codes
    assert decode_code.count("#pragma omp for schedule(guided)") > 0
    assert "#pragma omp for\n" not in decode_code  # no loop left on the static default

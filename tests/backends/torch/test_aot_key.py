"""The key a compiled step's package is kept under (``linnet.backends.torch.aot.step_key``)."""
from __future__ import annotations

import torch
from torch._inductor import config

from linnet.backends.torch.aot import STATE, step_key


def test_the_key_holds_the_vector_width_asked_for(monkeypatch):
    """AVX2 code asked for on an AVX-512 CPU (ATEN_CPU_CAPABILITY, or inductor's simdlen) is another package."""
    model, example = torch.nn.Linear(2, 2), (torch.zeros(1, 2),)
    for name in STATE:
        setattr(model, name, torch.zeros(1))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    keys = {step_key("m", model, example, False)}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    keys.add(step_key("m", model, example, False))
    with config.patch({"cpp.simdlen": 256}):  # (monkeypatch would delete the entry when it undoes)
        keys.add(step_key("m", model, example, False))
    assert len(keys) == 3
    assert step_key("m", model, example, False) in keys  # the same ask, the same key

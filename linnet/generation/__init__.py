"""Generation on top of the Runner contract: streamed text with stop strings, the one-request loop."""
from linnet.generation.loop import GenerationResult, generate
from linnet.generation.text import TextStream
from linnet.sampling import Sampling

__all__ = ["GenerationResult", "Sampling", "TextStream", "generate"]

"""Generation on top of the Runner contract: sampling, streamed text with stop strings, the loop."""
from linnet.generation.loop import Generation, generate
from linnet.generation.sampling import Sampler, Sampling
from linnet.generation.text import TextStream

__all__ = ["Generation", "Sampler", "Sampling", "TextStream", "generate"]

"""The PyTorch backend: generated standalone source, run eager, under inductor, or with CUDA graphs."""

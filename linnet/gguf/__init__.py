"""GGUF in and out, for every architecture in the form llama.cpp's graph of its family reads:
``reader.load_gguf`` (quantised tensors dequantised) and ``export.export_gguf`` (a file llama.cpp loads)."""

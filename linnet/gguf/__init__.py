"""GGUF in and out: ``reader.load_gguf`` (llama, qwen2, qwen3; quantised tensors dequantised) and
``export.export_gguf`` (a file llama.cpp loads)."""

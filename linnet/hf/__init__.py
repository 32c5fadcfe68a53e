"""Hugging Face checkpoints out: ``export.export_hf``."""

"""Linnet: describe a decoder-only LLM once, from its published checkpoint, and run it fast anywhere."""
__version__ = "0.1.0"

"""Subcommands of ``linnet``; each module defines ``register(subparsers)``."""

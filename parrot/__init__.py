"""Parrot: serving LLM applications with semantic variables."""

__version__ = "0.1.0"

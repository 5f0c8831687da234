"""Prompt-R1 pipeline library."""

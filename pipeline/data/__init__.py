"""Data stages: sources (Hub or local mirror) → normalise → sample → validate (GX) → build RL/eval sets."""

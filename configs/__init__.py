"""Frozen launch-heuristic tables emitted by `normtune emit` (one JSON file per GPU), shipped in the wheel."""

"""Metric sinks (JSONL, TensorBoard) and terminal progress."""

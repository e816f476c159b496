"""Generating and scoring prompt groups, for training rollouts and for validation."""

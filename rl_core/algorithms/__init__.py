"""Advantage estimators and policy losses: pure tensor functions tested against hand-computed values."""

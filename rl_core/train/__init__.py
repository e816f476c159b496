"""Training backends behind the TrainerBackend protocol (split step API)."""

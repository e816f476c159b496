"""The replay buffer of prompt-group slots."""

"""Entry points: the rl-core CLI, in-process training, and (for the workflow) the submitit job."""

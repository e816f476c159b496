"""rl_core: asynchronous RL post-training for language models.

A single controller runs a rollout pump and a train pump concurrently (see
`rl_core.controller`); everything else is a small part behind a protocol
(`rl_core.protocols`) so that the same loop runs on a laptop CPU and on a cluster.
"""

__version__ = "0.1.0"

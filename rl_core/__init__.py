"""rl_core: asynchronous RL post-training for language models.

A single controller runs a rollout pump and a train pump concurrently (see
`rl_core.controller`); everything else is a small part behind a protocol
(`rl_core.protocols`) so that the same loop runs on a laptop CPU and on a cluster.
"""

__version__ = "0.1.0"  # pyproject.toml's version (tests/unit/test_cli_tools.py checks they agree)


def package_version() -> str:
    """The installed distribution's version (importlib.metadata); `__version__` in a source tree
    that is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rl_core")
    except PackageNotFoundError:
        return __version__

"""rl_core's test suite; `tests.helpers` holds what the test modules share."""

"""The single controller: rollout pump, train pump, refit, and their coordination."""

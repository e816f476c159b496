"""Test-suite wide setup. Shared fakes, fixtures and builders live in the `tests.helpers`
package, imported as `tests.helpers.<module>` (pytest puts the repository root on sys.path:
`pythonpath = ["."]` in pyproject.toml)."""

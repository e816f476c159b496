"""Test-suite wide setup: make `tests/helpers` importable (shared fakes and utilities)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

"""Shared pytest setup.

The repository root goes first on ``sys.path`` so tests can ``import examples.gpt`` (the examples are not
part of the installed package). ``autopar`` itself resolves to the same files either way: the project is
installed editable, and the root copy is the one that install points at.
"""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

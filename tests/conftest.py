"""Shared pytest setup.

The repository root goes first on ``sys.path`` so tests can ``import examples.gpt`` (the examples are not
part of the installed package). ``autopar`` itself resolves to the same files either way: the project is
installed editable, and the root copy is the one that install points at.
"""

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture
def fake_process_group():
    """A world of 4 ranks on torch's fake backend (no communication), torn down after the test."""
    from autopar.tools.fake_ranks import fake_world

    with fake_world(4):
        yield

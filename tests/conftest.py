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
    """A world of 4 ranks on torch's fake backend (no communication), torn down after the test.

    The fake backend and its store live in torch's testing package; importing them here, in one
    place, makes a move in torch fail every test that needs them with an ImportError.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar import collectives

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()
    collectives.forget_meshes()

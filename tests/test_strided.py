"""Strided shards: DTensor's private ``_StridedShard`` still means what autopar relies on.

``autopar/ir/strided.py`` is the one place that imports it. If torch renames the class or
changes which piece a rank holds, these tests fail here, not as wrong numbers elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import autopar
from autopar.capture.strategies import lower_strategy
from autopar.ir.layout import format_layout, is_valid_for, local_shape, parse_layout
from autopar.ir.mesh import MeshSpec
from autopar.ir.strided import is_split, parts_of, strided
from autopar.runtime.materialize import local_piece
from autopar.tools.fake_ranks import fake_world


@pytest.mark.parametrize("rank", range(4))
def test_a_rank_holds_its_piece_of_every_part_as_dtensor_says(rank):
    whole = torch.arange(24.0).view(2, 12)  # dim 1: 3 parts of 4 columns, each split over 4 ranks
    with fake_world(4, rank=rank):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        placement = strided(1, 3)
        held = distribute_tensor(whole, mesh, [placement], src_data_rank=None).to_local()
        assert torch.equal(held, whole[:, [rank, 4 + rank, 8 + rank]])
        assert torch.equal(local_piece(whole, (placement,), mesh), held)


def test_strided_layouts_print_parse_and_localise():
    mesh = MeshSpec(("dp", "tp"), (2, 4))
    layout = parse_layout("RS(1)x3")
    assert layout[1] == strided(1, 3)
    assert format_layout(layout) == "RS(1)x3" and parts_of(layout[1]) == 3 and is_split(layout[1])
    assert strided(1, 1) == Shard(1)
    assert local_shape((64, 192), layout, mesh) == (64, 48)
    assert is_valid_for(layout, (64, 192), mesh) and not is_valid_for(layout, (64, 30), mesh)


def test_parts_annotations_lower_to_strided_shards_and_check_sizes():
    mesh = MeshSpec(("dp", "tp"), (2, 4))
    qkv = autopar.Parts("tp", 3)
    assert lower_strategy((None, qkv), (64, 192), mesh, where="x") == parse_layout("RS(1)x3")
    with pytest.raises(autopar.AnnotationError, match=r"dim 1 has size 30, which cannot be split into 12"):
        lower_strategy((None, qkv), (64, 30), mesh, where="x")
    with pytest.raises(autopar.AnnotationError, match="at least 2 parts"):
        lower_strategy((None, autopar.Parts("tp", 1)), (64, 192), mesh, where="x")
    with pytest.raises(autopar.AnnotationError, match="unknown mesh axis 'pp'"):
        lower_strategy((autopar.Parts("pp", 3), None), (192, 64), mesh, where="x")

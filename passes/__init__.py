"""Graph passes of autopar, one per file; each module exposes ``run(gm, ctx) -> gm``.

:data:`PASS_ORDER` is the order ``autopar.compile`` runs them in: from the captured
graph plus a plan to the per-rank program. Each pass's docstring names the
``node.meta`` keys it reads and writes.
"""

from autopar.passes import (
    apply_plan,
    apply_recompute,
    check_local_program,
    drop_layout_constraints,
    insert_redistributions,
    localize_lookups,
    localize_shapes,
    localize_views,
    lower_collectives,
    mark_recompute,
    place_on_device,
    split_stages,
    strip_export_checks,
    verify_layouts,
)

PASS_ORDER = (
    strip_export_checks,  # drop export's checks of global shapes and devices
    place_on_device,  # tensors the program creates: on this rank's device, not the capture's
    apply_plan,  # the plan's layouts onto the nodes; the plan must fit the model
    insert_redistributions,  # a redistribute wherever a value's or gradient's layout changes
    lower_collectives,  # each redistribute -> one autograd-aware collective per mesh axis
    drop_layout_constraints,  # pinned layouts are in place: the constraints are identities now
    localize_shapes,  # size arguments -> local sizes; split means rescaled
    localize_lookups,  # lookups into a split dim: this rank's block, the rest masked
    localize_views,  # views -> reshapes: a rank's pieces may have strides one device's values lacked
    verify_layouts,  # every edge: producer layout == consumer expectation
    check_local_program,  # the program run once on fake tensors of this rank's pieces
    mark_recompute,  # the ops recomputed in backward: recompute modules, ZeRO-3 gathers
    apply_recompute,  # each recompute region -> one checkpointed submodule
    split_stages,  # under a pipeline: one program per stage, boundaries carried through
)

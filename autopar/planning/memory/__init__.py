"""Memory: what a rank holds under a plan (ZeRO splits, state, saved activations, recompute).

Entry point: :func:`~autopar.planning.memory.model.activation_memory` (activations per rank);
``held_state`` (parameters and optimizer state per ZeRO stage), ``saved_tensors`` (what each op
keeps for backward), ``recompute`` and ``recompute_peak`` (regions and their peak). Imports
``planning.cost`` and ``planning.graph``."""

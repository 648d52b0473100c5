"""Capture: the user's annotations (``shard``, ``constrain``, ``pipeline_stage``, ``recompute``),
MindSpore strategy forms lowered to layouts, and the model captured by ``torch.export``."""

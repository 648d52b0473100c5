"""Assembly: from a solved assignment to a :class:`~autopar.ir.plan.Plan`.

Entry point: :func:`~autopar.planning.assembly.assemble.assemble_plan`; ``named_layouts`` and
``axis_roles`` name what the plan shows, ``plan_fit`` records annotations and input shapes and
checks a saved plan fits a model. Imports the packages below it: cost, graph, pipeline, memory."""

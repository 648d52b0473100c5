"""Assembly: from a solved assignment to a :class:`~autopar.ir.plan.Plan`.

Entry points: :func:`~autopar.planning.assembly.assemble.evaluate_plan` (what the searches compare
every solve by) and :func:`~autopar.planning.assembly.assemble.record_plan` (the report, written
once, for the plan returned); ``named_layouts`` and
``axis_roles`` name what the plan shows, ``plan_fit`` records annotations and input shapes and
checks a saved plan fits a model. Imports the packages below it: cost, graph, pipeline, memory."""

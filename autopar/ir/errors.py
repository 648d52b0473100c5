"""The errors autopar raises on bad input.

Every message names what the user wrote (module path, tensor, dimension) and what
was expected, so no traceback from deep inside torch is needed to act on it.
"""


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class AnnotationError(AutoparError, ValueError):
    """An annotation (shard, constrain, pipeline_stage, recompute) is malformed or inconsistent."""


class CaptureError(AutoparError, RuntimeError):
    """The model could not be captured as a graph."""


class PlanError(AutoparError, RuntimeError):
    """No plan satisfies the annotations, or a saved plan cannot be read."""


class MemoryFitError(PlanError):
    """No plan fits the memory budget; ``least_bytes`` is the least memory per device reached (under
    a pipeline, the pipeline rank's holding the most: every stage it runs)."""

    def __init__(self, message: str, least_bytes: int) -> None:
        super().__init__(message)
        self.least_bytes = least_bytes

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        # pickled with both arguments (a mesh planned in a forked process sends it back)
        return type(self), (str(self), self.least_bytes)


class CompileError(AutoparError, RuntimeError):
    """The plan cannot be turned into a per-rank program, or the program disagrees with the plan."""


class ShapeError(AutoparError, ValueError):
    """A compiled module was called with inputs other than it was compiled for: other shapes or
    structure, or a training step without what it needs (a target, a loss)."""


class IndexRangeError(AutoparError, IndexError, RuntimeError):
    """A lookup into a dimension split across ranks (a vocab-parallel embedding, a cross entropy's
    target logit) was given ids outside the whole dimension: raised on every rank where one device
    raises ``IndexError`` (``RuntimeError`` for ``gather``)."""


class InitializationError(AutoparError, ValueError):
    """A model built on ``meta`` has a tensor whose initial value nothing in the model defines,
    or one of its initializers failed: the message names each tensor and what to do."""


class OptionError(AutoparError, ValueError, TypeError):
    """An argument of ``plan``/``compile`` or an option object (a mesh, ``Memory``, ``Pipeline``, a
    cluster, a time limit) has the wrong type or value; nothing is coerced."""


class CheckpointError(AutoparError, RuntimeError):
    """A checkpoint cannot be read back into this module and optimizer (``autopar.load_checkpoint``)."""


class CollectiveMismatchError(AutoparError, RuntimeError):
    """A call every rank must make together (``StepMeter.step()``) was not made by every rank
    within its timeout: the message names the call, the step and the ranks missing where known."""

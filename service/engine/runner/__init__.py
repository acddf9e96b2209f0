"""The model runner: the step ABI (what one step holds) and the runner that executes it."""

from service.engine.runner.model_runner import (
    GREEDY,
    ModelRunner,
    RowSampling,
    StepInput,
    StepOutput,
)

__all__ = ["GREEDY", "ModelRunner", "RowSampling", "StepInput", "StepOutput"]

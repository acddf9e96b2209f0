"""The model runner: the step ABI (step.py: what one step holds, how its rows choose, what comes
back) and ModelRunner (model_runner.py), which runs such steps for the target and every draft
model. Both are importable from here."""

from service.engine.runner.model_runner import DRAFT, TARGET, ModelRunner, RunnerKind
from service.engine.runner.step import GREEDY, RowSampling, StepInput, StepOutput

__all__ = ["DRAFT", "GREEDY", "TARGET", "ModelRunner", "RowSampling", "RunnerKind", "StepInput",
           "StepOutput"]

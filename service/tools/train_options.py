"""`specstream train-drafter`'s options (service/tools/train_drafter.py), apart so that the CLI
reads their defaults without importing the trainer."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("eagle3",)


@dataclass(frozen=True)
class TrainOptions:
    kind: str = "eagle3"
    prompts: str = ""                  # JSON-lines file; "": the shipped corpus
    n_prompts: int = 0                 # N of the prompts (a seeded sample); 0: all
    tokens: int = 64                   # generated per prompt
    max_prompt: int = 256              # prompt tokens kept
    holdout: float = 0.1               # fraction of prompts held out
    draft_vocab: int = 0               # 0: the target's vocabulary
    unroll: int = 1
    epochs: int = 4
    batch: int = 8
    lr: float = 1e-3
    max_seconds: float = 0.0           # > 0: training time budget
    target_layers: tuple[int, ...] | None = None
    norm_before_fc: bool = False
    quant: str = "F16"
    depth: int = 4                     # chain depth the acceptance is measured to
    seed: int = 0
    backend: str = "cpu"               # the target's, for generation and the engine check
    threads: int = 0
    slots: int = 64                    # sequences generated at once
    engine_prompts: int = 0            # held-out prompts the engine check runs; 0: none
    soft_labels: int = 0               # > 0: train on the target's top-N distribution
    weight_decay: float = 0.0          # AdamW's decoupled decay of the matrices
    data: str = ""                     # .npz of the generation (reused when it matches)

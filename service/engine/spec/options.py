"""Per-request speculation: a request's options resolved against the server's configuration.

The server decides what speculation can do (its drafter, `verify_width`, `tree_budget`); a
request may switch it off, pick chain or tree verify, and narrow the width or the tree budget
within those limits. `resolve` turns (enabled, SpeculativeOptions) into what a Sequence runs
with, or raises InvalidRequestError naming the field:

    INVALID_ARGUMENT     tree mode with sampling.repetition_penalty != 1 (see resolve);
                         a value out of range (`speculative.width` outside 2..verify_width,
                         `speculative.tree_budget` outside 2..tree_budget, an unknown mode) or
                         contradicting another (enabled=false with mode chain/tree, mode off
                         with enabled=true, width or tree_budget with speculation off,
                         tree_budget with mode chain)
    FAILED_PRECONDITION  speculation asked for (enabled=true, a mode other than off, a width or
                         a tree budget) from a server without a drafter or with verify_width 1;
                         tree mode from a server whose tree_budget is 0

Unset options take the server's defaults: speculation on when it has a drafter, chain verify of
verify_width rows, or tree verify of tree_budget nodes when tree_budget > 0. A tree budget given
without a mode selects tree mode, as `--tree-budget` does on the command line. Whatever is
chosen, the output is the same tokens as plain decoding (spec/chain.py says why).

Each request is resolved once: the gRPC server resolves while converting it (so a refused request
is never tokenized) and passes the result in GenerationRequest.speculation; the engine resolves
at submit only a request that comes without it (the CLI, benchmarks, tests).
"""

from __future__ import annotations

from service.config import EngineConfig
from service.engine.types import SPECULATIVE_MODES, Speculation, SpeculativeOptions
from service.errors import InvalidRequestError

__all__ = ["Speculation", "resolve"]


def _precondition(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(field, message, reason="FAILED_PRECONDITION")


def resolve(enabled: bool | None, opts: SpeculativeOptions, config: EngineConfig,
            has_drafter: bool, repetition_penalty: float = 1.0,
            reads_history: bool = False) -> Speculation:
    """The speculation of one request, or InvalidRequestError naming the offending field.

    A request with a repetition penalty (or, reads_history, a frequency / presence penalty:
    SamplingParams.reads_history) verifies chains: its penalty window reads the token history
    by position, which the nodes of one tree depth share. Asking for tree mode with a penalty
    is INVALID_ARGUMENT; a server default of tree verify falls back to chain."""
    mode, width, budget = opts.mode, opts.width, opts.tree_budget
    if _switched_off(enabled, opts):
        return Speculation(False, config.verify_width, 0)
    asked = [name for name, given in (("enabled", enabled is True),
                                      ("mode", mode is not None), ("width", width is not None),
                                      ("tree_budget", budget is not None)) if given]
    able = has_drafter and config.verify_width >= 2
    if asked and not able:
        raise _precondition(f"speculative.{asked[0]}", "speculation was requested but the "
                            f"server runs with drafter={config.drafter!r}, verify_width="
                            f"{config.verify_width}")
    if width is not None and not 2 <= width <= config.verify_width:
        raise InvalidRequestError("speculative.width", f"must be in [2, {config.verify_width}] "
                                  f"(the server's verify_width), got {width}")
    if mode == "chain" and budget is not None:
        raise InvalidRequestError("speculative.tree_budget", "applies to tree mode, not to "
                                  "mode chain")
    tree = _tree(opts, config, repetition_penalty != 1.0 or reads_history)
    if budget is not None and not 2 <= budget <= config.tree_budget:
        raise InvalidRequestError("speculative.tree_budget", f"must be in [2, "
                                  f"{config.tree_budget}] (the server's tree_budget), got "
                                  f"{budget}")
    return Speculation(able, width or config.verify_width,
                       (budget or config.tree_budget) if tree else 0)


def _switched_off(enabled: bool | None, opts: SpeculativeOptions) -> bool:
    """Whether the request turns speculation off; refuses a mode that is unknown or contradicts
    `enabled`, and a width or tree budget given with speculation off."""
    mode = opts.mode
    if mode is not None and mode not in SPECULATIVE_MODES:
        raise InvalidRequestError("speculative.mode", f"unknown mode {mode!r}; one of "
                                  + ", ".join(SPECULATIVE_MODES))
    if enabled is False and mode in ("chain", "tree"):
        raise InvalidRequestError("speculative.mode", f"mode {mode} contradicts "
                                  "speculative.enabled = false")
    if enabled is True and mode == "off":
        raise InvalidRequestError("speculative.mode", "mode off contradicts "
                                  "speculative.enabled = true")
    if enabled is not False and mode != "off":
        return False
    for name, value in (("width", opts.width), ("tree_budget", opts.tree_budget)):
        if value is not None:
            raise InvalidRequestError(f"speculative.{name}", f"set to {value} while "
                                      "speculation is off")
    return True


def _tree(opts: SpeculativeOptions, config: EngineConfig, penalised: bool) -> bool:
    """Whether the request verifies a tree (asked for, or the server's default)."""
    mode, budget = opts.mode, opts.tree_budget
    tree = mode == "tree" or (mode is None and (budget is not None or config.tree_budget > 0))
    if tree and config.tree_budget == 0:
        raise _precondition("speculative.tree_budget" if budget is not None
                            else "speculative.mode", "tree verify needs a server started with "
                            "tree_budget > 0 (--tree-budget); this one verifies chains")
    if tree and penalised:
        if mode == "tree" or budget is not None:
            raise InvalidRequestError("speculative.mode" if mode == "tree"
                                      else "speculative.tree_budget",
                                      "tree verify does not combine with "
                                      "sampling.repetition_penalty != 1 or a "
                                      "frequency_penalty / presence_penalty != 0 (the penalties "
                                      "read the token history by position, which sibling nodes "
                                      "share); use mode chain")
        return False
    return tree

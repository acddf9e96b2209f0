"""Chat templates as a configuration names them: the built-ins, a Jinja file's text checked at
startup, and the sandbox every template compiles in.

A leaf (it imports nothing of the service but errors), so `service.config` can check a
`--chat-template NAME|FILE` choice with the other settings, all problems at once, and the model
layer renders with the same environment (service/model/chat.py).

The environment is set up as HuggingFace's `apply_chat_template` sets it: trim_blocks and
lstrip_blocks, the loop-controls extension, `raise_exception`, `strftime_now` and a `tojson`
filter that keeps non-ASCII text. Templates come from model files, so they run in an immutable
sandbox and any attribute the sandbox deems unsafe (dunders, mutating methods) fails the render
instead of rendering as empty.

A template can also loop for ever (three nested `range(99999)` are 10^15 iterations), so every
render runs under a `RenderWatch`: a work bound counted in steps (a range item, a call, an
attribute or item lookup, an output chunk: `MAX_RENDER_STEPS`), bounds on the size of one value
(`MAX_RENDER_CHARS`, exponents) and of the output, and a deadline (`RENDER_DEADLINE_S`). Loops
that touch nothing countable (nested loops over one string set outside them) are stopped by the
deadline: the watch raises `RenderStopped` in the rendering thread asynchronously, which Python
delivers between two bytecodes of the template's compiled code. The same call stops a render
whose request was cancelled (`RenderWatch.interrupt`). The render then fails that request only,
and its thread is free again.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

from service.errors import ConfigError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma turns: roles user/model, system text folded into the next turn, content trimmed.
GEMMA_TURNS = (
    "{% set state = namespace(prefix='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set state.prefix = state.prefix + (message['content'] | trim) + '\\n\\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + state.prefix + (message['content'] | trim)"
    " + '<end_of_turn>\\n' }}"
    "{% set state.prefix = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# --chat-template NAME -> template text
BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "gemma": GEMMA_TURNS}
SETTING = "chat_template"


def load_template(choice: str) -> str:
    """The template `choice` names: a built-in's name, else a Jinja file's path. The text is
    compiled here, so a bad choice is a ConfigError at startup, not a failed request."""
    if choice in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[choice]
    names = ", ".join(BUILTIN_TEMPLATES)
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ConfigError([(SETTING, f"{choice!r} is neither a built-in template ({names}) "
                                     "nor a Jinja template file")])
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([(SETTING, f"cannot read template file {choice!r}: {exc}")]) from exc
    try:
        compile_template(text)
    except TemplateError as exc:
        raise ConfigError([(SETTING, f"{choice!r} is not a valid Jinja template: {exc}")]) from exc
    return text


# ------------------------------------------------------------------------- bounded renders
MAX_RENDER_STEPS = 5_000_000     # counted steps of one render (a real chat template: ~50/message)
MAX_RENDER_CHARS = 64 << 20      # characters of one value or of the whole output
MAX_EXPONENT = 4096              # `a ** b`: larger b is refused (10 ** 10 ** 9 never finishes)
RENDER_DEADLINE_S = 5.0          # wall time of one render


class RenderStopped(Exception):
    """A render exceeded its bounds or was interrupted; the message says which."""


class RenderWatch:
    """The bounds of one render and the means to stop it from another thread.

    `run(fn)` calls fn on this thread with the watch current (`step()` counts against it) and a
    timer armed for the deadline. `interrupt(reason)` raises RenderStopped(reason) in that
    thread (PyThreadState_SetAsyncExc); it fires at most once, never after `run` returned, and a
    pending one is cleared when fn returns first, so the exception cannot escape into whatever
    the thread runs next.
    """

    def __init__(self, deadline_s: float | None = None, max_steps: int | None = None) -> None:
        self.deadline_s = RENDER_DEADLINE_S if deadline_s is None else deadline_s
        self.max_steps = MAX_RENDER_STEPS if max_steps is None else max_steps
        self.steps = 0
        self._lock = threading.Lock()
        self._thread_id: int | None = None
        self._state = "new"              # new -> running -> done; interrupted: fired while running
        self.reason: str | None = None

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise RenderStopped(f"the chat template exceeded its work bound ({self.max_steps} "
                                "steps)")

    def interrupt(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            if self._state != "running":
                return
            self._state = "interrupted"
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id),
                                                       ctypes.py_object(RenderStopped))

    def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self.reason is not None:          # interrupted before it began
                raise RenderStopped(self.reason)
            self._thread_id, self._state = threading.get_ident(), "running"
        timer = threading.Timer(self.deadline_s, self.interrupt, (
            f"the chat template ran past its deadline ({self.deadline_s:g} s)",))
        timer.daemon = True
        token = _current.set(self)
        try:
            try:
                timer.start()
                return fn()
            finally:
                timer.cancel()
                _current.reset(token)
                self._finish()
        except RenderStopped as exc:
            raise RenderStopped(self.reason or str(exc)) from None

    def _finish(self) -> None:
        with self._lock:
            fired = self._state == "interrupted"
            self._state = "done"
        if fired:                                # clear it if it was not delivered yet
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), None)


_current: ContextVar[RenderWatch | None] = ContextVar("render_watch", default=None)
_given: ContextVar[RenderWatch | None] = ContextVar("render_watch_given", default=None)


@contextmanager
def watching(watch: RenderWatch) -> Iterator[RenderWatch]:
    """Renders on this thread inside the block use `watch` (a caller that may interrupt them)."""
    token = _given.set(watch)
    try:
        yield watch
    finally:
        _given.reset(token)


def render_bounded(template: str, **variables: Any) -> str:
    """`template` rendered with `variables` under the watch given by `watching`, else a new one.
    RenderStopped when it exceeds a bound or is interrupted."""
    watch = _given.get() or RenderWatch()

    def render() -> str:
        out, size = [], 0
        for chunk in compile_template(template).generate(**variables):
            watch.step()
            size += len(chunk)
            if size > MAX_RENDER_CHARS:
                raise RenderStopped(f"the chat template's output exceeds {MAX_RENDER_CHARS} "
                                    "characters")
            out.append(chunk)
        return "".join(out)

    return watch.run(render)


def _step() -> None:
    watch = _current.get()
    if watch is not None:
        watch.step()


class _CountedRange:
    """range() whose iteration counts a step per item (the sandbox's own size check first)."""

    def __init__(self, *args: int) -> None:
        self._range = safe_range(*args)

    def __iter__(self) -> Iterator[int]:
        for i in self._range:
            _step()
            yield i

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, i: Any) -> Any:
        return self._range[i]


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of "
                            f"{type(obj).__name__!r} object is unsafe")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _step()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _step()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _step()
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"exponent {right} exceeds {MAX_EXPONENT}")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if (isinstance(seq, str | list | tuple) and isinstance(n, int)
                        and len(seq) * n > MAX_RENDER_CHARS):
                    raise SecurityError(f"a value of {len(seq) * n} items exceeds "
                                        f"{MAX_RENDER_CHARS}")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(template: str) -> Any:
    """`template` compiled in the sandbox (cached by its text)."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       range=_CountedRange)
    env.globals.pop("lipsum", None)          # lorem ipsum of any length: no template needs it
    return env.from_string(template)

"""A chat template's render, sandboxed and bounded.

A chat template comes with the model file, so it is code from whoever made the file, and
what it renders comes from the client. Jinja's ImmutableSandboxedEnvironment keeps it
from reaching Python's internals; this module bounds its work, since a Python thread
cannot be stopped from outside: every bound is checked inside the render, and the first
one crossed ends it with TemplateLimitError (the server's 400, the CLI's one line).

    steps    each loop iteration, call (macro, method, global), filter, `~` and
             intercepted operator is a step; each step also checks the clock
    seconds  the render's wall time, checked at each step
    chars    every piece the template writes (to its output, a macro's or a block's
             buffer) adds to one count; and no value it builds (an operator's, a
             filter's or a call's result) may be longer than this

Values are checked before they are built where their size is known from the operands
(`'a' * 10**11`, `x ** 10**9`, an int argument past the bound, a separator times a
list), else right after, so a render never holds more than a few times `chars`.
How: the code generator (Jinja's `code_generator_class` hook) wraps each for loop's
iterable in a counting iterator and each output piece and `~` in a counter; the sandbox's
own hooks (`call`, `intercepted_binops`) and wrapped filters do the rest.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """What one render may spend; `per_message` steps and `per_char` characters are added
    for each message and each character of text it is given (a long conversation renders
    with room for it)."""

    steps: int = 1_000_000
    seconds: float = 5.0
    chars: int = 8 << 20
    per_message: int = 1_000
    per_char: int = 4


class TemplateLimitError(jinja2.TemplateRuntimeError):
    """The render crossed one of its bounds (TemplateLimits)."""


class _Budget:
    """One render's allowance, spent by every hook (sticky: once crossed, each later step
    raises again, should something in between swallow the first)."""

    __slots__ = ("chars", "crossed", "deadline", "limits", "steps", "written")

    def __init__(self, limits: TemplateLimits, messages: int, text: int) -> None:
        self.limits = limits
        self.steps = limits.steps + limits.per_message * messages
        self.chars = limits.chars + limits.per_char * text
        self.deadline = time.monotonic() + limits.seconds
        self.written = 0
        self.crossed: str | None = None

    def step(self) -> None:
        self.steps -= 1
        if self.crossed is None:
            if self.steps < 0:
                self.crossed = f"more than {self.limits.steps:,} steps (loops, calls, filters)"
            elif time.monotonic() > self.deadline:
                self.crossed = f"more than {self.limits.seconds:g} s"
        if self.crossed is not None:
            raise TemplateLimitError(f"the chat template ran past its bound: {self.crossed}")

    def room(self, size: int, what: str) -> None:
        """A value (or the output) of `size` characters or items may be made."""
        if size > self.chars:
            self.crossed = f"{what} of more than {self.chars:,} characters"
            raise TemplateLimitError(f"the chat template ran past its bound: {self.crossed}")


_FORMAT_WIDTH = re.compile(r"\d{7,}")  # a width or precision in a format string


_SIZED = (str, bytes, list, tuple, dict, range, set, frozenset)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


class _Generator(CodeGenerator):
    """Jinja's code generator with the counters written in: a loop iterates through
    `environment.kvlm_counted`, each output piece and `~` passes through
    `environment.kvlm_written` / `kvlm_sized`."""

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        if not getattr(node, "kvlm_counted", False):
            node.kvlm_counted = True  # type: ignore[attr-defined]
            node.iter = nodes.Call(
                nodes.EnvironmentAttribute("kvlm_counted"), [node.iter], [], None, None,
                lineno=node.lineno,
            )  # fmt: skip
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.kvlm_sized(")
        super().visit_Concat(node, frame)
        self.write(")")

    def _output_const_repr(self, group: Iterable[Any]) -> str:
        return f"environment.kvlm_written({super()._output_const_repr(group)})"

    def _output_child_pre(self, node: nodes.Expr, frame: Any, finalize: Any) -> None:
        self.write("environment.kvlm_written(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node: nodes.Expr, frame: Any, finalize: Any) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment whose renders spend a budget (TemplateLimits): one
    environment serves renders on many threads at once, each with its own budget."""

    code_generator_class = _Generator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._budgets = threading.local()
        self.globals.pop("lipsum", None)  # a text generator sized by its arguments
        self.filters = {name: self.bounded(f) for name, f in self.filters.items()}

    def budget(self) -> _Budget:
        """This thread's render's budget (outside render(), a fresh one each time: a
        template rendered some other way is not bounded)."""
        current = getattr(self._budgets, "current", None)
        return current if current is not None else _Budget(TemplateLimits(), 0, 0)

    def render(
        self, template: jinja2.Template, limits: TemplateLimits, messages: int, text: int,
        variables: dict[str, Any],
    ) -> str:  # fmt: skip
        """`template` rendered with `variables` within `limits` (TemplateLimitError)."""
        budgets = self._budgets
        budgets.current = _Budget(limits, messages, text)
        try:
            return template.render(variables)
        finally:
            budgets.current = None

    # the hooks the generated code calls -------------------------------------------

    def kvlm_counted(self, iterable: Iterable[Any]) -> Iterator[Any]:
        budget = self.budget()
        for item in iterable:
            budget.step()
            yield item

    def kvlm_written(self, piece: str) -> str:
        budget = self.budget()
        budget.step()
        budget.written += len(piece)
        budget.room(budget.written, "output")
        return piece

    def kvlm_sized(self, value: Any) -> Any:
        budget = self.budget()
        budget.step()
        budget.room(_size(value), "a value")
        return value

    # the sandbox's own hooks -------------------------------------------------------

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = __self.budget()
        budget.step()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (__self.kvlm_counted(args[0]), *args[1:])
        _check_arguments(budget, getattr(__obj, "__self__", None), args, kwargs,
                         getattr(__obj, "__name__", ""))  # fmt: skip
        result = super().call(__context, __obj, *args, **kwargs)
        budget.room(_size(result), "a value")
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget()
        budget.step()
        if operator == "*":
            _check_product(budget, left, right)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right * left.bit_length() > budget.chars:
                budget.room(budget.chars + 1, f"a power ({left} ** {right})")
        elif operator == "%" and isinstance(left, str):
            _check_format(budget, left, right if isinstance(right, tuple) else (right,))
        result = super().call_binop(context, operator, left, right)
        budget.room(_size(result), "a value")
        return result

    def bounded(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """Filter `f`, spending the budget (each filter of the environment is one)."""

        @functools.wraps(f)  # keeps jinja_pass_arg (pass_context and the like)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            budget = self.budget()
            budget.step()
            at = next((i for i, a in enumerate(args) if not isinstance(a, _PASSED)), len(args))
            if at < len(args) and isinstance(args[at], Iterator):  # (map, select, ...)'s
                # made whole, so its size is known: what comes next consumes it anyway
                args = (*args[:at], list(self.kvlm_counted(args[at])), *args[at + 1 :])
            subject = args[at] if at < len(args) else None
            _check_arguments(budget, subject, args[at + 1 :], kwargs, "")
            result = f(*args, **kwargs)
            budget.room(_size(result), "a value")
            return result

        return bounded


_PASSED = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)


def _check_arguments(
    budget: _Budget, subject: Any, args: tuple | list, kwargs: dict[str, Any], name: str
) -> None:
    """Refuse a call whose result the operands already show too large: an int argument
    past the bound (a width, a count), or two sized operands whose product is (a
    separator joining a list, a replacement in a text)."""
    given = [*args, *kwargs.values()]
    for value in given:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > budget.chars:
            budget.room(abs(value), f"an argument ({value})")
    sizes = sorted((_size(v) for v in (subject, *given)), reverse=True)
    if len(sizes) > 1 and sizes[0] * sizes[1] > budget.chars:
        budget.room(sizes[0] * sizes[1], "a value")
    if name in ("format", "format_map") and isinstance(subject, str):
        _check_format(budget, subject, given)


def _check_product(budget: _Budget, left: Any, right: Any) -> None:
    if isinstance(left, int) and not isinstance(left, bool):
        left, right = right, left
    if isinstance(right, int) and not isinstance(right, bool):
        if isinstance(left, int):
            bits = left.bit_length() + right.bit_length()
            if bits > budget.chars:
                budget.room(bits, "a product")
        else:
            budget.room(_size(left) * max(right, 0), "a value")


def _check_format(budget: _Budget, text: str, args: Any) -> None:
    """A format string's widths and precisions ('%1000000000d', '{:>1000000000}') and
    '*' widths taken from the arguments are sizes too."""
    for digits in _FORMAT_WIDTH.findall(text):
        budget.room(int(digits), "a formatted value")
    for value in args:
        if isinstance(value, int) and not isinstance(value, bool):
            budget.room(abs(value), "a formatted value")

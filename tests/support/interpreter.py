"""A faster Triton interpreter for the test children: nested ``@triton.jit`` calls skip a
redundant re-patch of ``triton.language``.

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor.__call__``) patches the language
modules its function sees (``triton.language`` / ``triton.language.core``) with interpreted
builtins, runs every program, and restores them. Each call of a ``@triton.jit`` helper from
inside a kernel (``InterpretedFunction.__call__``) patches them again: it walks every member of
those modules with ``inspect.getmembers`` and finds them patched already (a patched builtin is
no longer a builtin, so nothing changes), at about 1.5 ms a call. The GDN kernels call helpers
thousands of times per launch (the WY inverse's blocks, the loads and stores of 16-row
blocks), about a tenth of the interpreter's time.

:func:`install` makes a helper call skip that walk when it runs inside a launch and every
language module the helper's globals hold is patched already: by the launch, or by an earlier
helper call of the same launch (triton's helper call patches and never restores, so a module it
patched stays patched until the launch ends; ``tl.sum``, ``tl.zeros`` and ``tl.cumsum`` are such
helpers, seeing ``triton.language.core`` where the kernels see ``triton.language``). Anything
else (a helper called outside a launch, the first helper of a launch that sees a module not yet
patched) takes triton's own path.
The helper's body, its rewriting and the error it raises are triton's. Only the test children
install it (never the library): it relies on the interpreter's internals, so it checks that
they are the ones it knows (:func:`known_interpreter`: the helper call's body, statement by
statement) and otherwise leaves triton as it is (:func:`install` returns False).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from typing import Any

#: The environment of ranks that run the kernels under the interpreter (``run_ranks(
#: Interpreted(worker), n, env=INTERPRETED_RANK_ENV, ...)``): one thread each (the interpreter is
#: single-threaded numpy work). ``TRITON_INTERPRET`` is not in it: a spawn whose env sets it
#: starts fresh interpreters (``rank_start.FRESH_INTERPRETER_ENV``, ~3 s of imports a rank);
#: :class:`Interpreted` sets it inside the forked rank and re-imports triton there
#: (:func:`interpret_in_this_rank`).
INTERPRETED_RANK_ENV = {"OMP_NUM_THREADS": "1"}

_INSTALLED = False
_local = threading.local()


def _language_modules(fn: Any) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values()
                     if inspect.ismodule(v) and v in (tl, tl.core))


#: The body of ``InterpretedFunction.__call__`` that :func:`install` replaces (triton 3.x),
#: statement by statement: the shortcut only skips its first statement.
KNOWN_HELPER_CALL = ("_patch_lang(self.fn)", "fn = self.rewrite()",
                     "try:\n    return fn(*args, **kwargs)\nexcept Exception as e:\n"
                     "    raise InterpreterError(repr(e)) from e")


def known_interpreter(interp: Any) -> bool:
    """Whether ``triton.runtime.interpreter`` has what :func:`install` wraps, with a helper
    call whose body is :data:`KNOWN_HELPER_CALL` (any other triton is left as it is)."""
    import ast
    import textwrap

    needed = ("GridExecutor", "InterpretedFunction", "_patch_lang", "InterpreterError")
    if not all(hasattr(interp, name) for name in needed) or not all(
            hasattr(interp.InterpretedFunction, a) for a in ("rewrite", "__call__")):
        return False
    try:
        source = textwrap.dedent(inspect.getsource(interp.InterpretedFunction.__call__))
    except (OSError, TypeError):
        return False
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    return tuple(ast.unparse(node) for node in body) == KNOWN_HELPER_CALL


def install() -> bool:
    """Install the shortcut in this process (idempotent); True when it is active.

    Only under ``TRITON_INTERPRET=1`` and only on an interpreter :func:`known_interpreter`
    accepts."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    if not known_interpreter(interp):
        return False
    launch = interp.GridExecutor.__call__
    call = interp.InterpretedFunction.__call__
    langs_of: dict[Any, frozenset[int]] = {}

    def launch_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        stack = _local.__dict__.setdefault("stack", [])
        stack.append(set(_language_modules(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            stack.pop()

    def helper_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        stack = _local.__dict__.get("stack")
        if not stack:
            return call(self, *args, **kwargs)
        langs = langs_of.get(self.fn)
        if langs is None:
            langs = langs_of[self.fn] = _language_modules(self.fn)
        covered = stack[-1]
        if langs and langs <= covered:
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise interp.InterpreterError(repr(e)) from e
        out = call(self, *args, **kwargs)
        # triton's helper call patched ``langs`` and never restores that patch: they stay
        # patched until this launch ends (its restore touches only the launch's own changes)
        covered |= langs
        return out

    interp.GridExecutor.__call__ = launch_call
    interp.InterpretedFunction.__call__ = helper_call
    _INSTALLED = True
    return True


def require_interpreter() -> None:
    """For a ``tests.support.*_cases`` module run as a child: fail unless ``TRITON_INTERPRET=1``
    (triton reads it when a kernel module is imported, so it must be set before), then
    :func:`install`."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    install()


#: Our modules that decorate Triton kernels when imported (the rank must import them after
#: ``TRITON_INTERPRET`` is set)
_KERNEL_PACKAGES = ("overlap_runtime.ops.gdn.triton", "overlap_runtime.ops.causal_conv.triton")


def interpret_in_this_rank() -> None:
    """Make this rank, forked from the forkserver, run Triton kernels under the interpreter.

    The forkserver imported the ``triton`` package (``torch._dynamo`` does), which decorated its
    own ``triton.language`` helpers (``tl.sum``, ``tl.zeros``, ...) for compilation; a kernel
    interpreted here could not call them. This sets ``TRITON_INTERPRET=1`` and drops triton's
    Python modules (not its C extension) from ``sys.modules``, so the next import decorates them
    as interpreted functions (~0.1 s, against ~3 s for a fresh interpreter). Modules imported
    before keep the old objects: raises if a kernel module of ours is among them, or if the
    helpers still are not interpreted after the re-import."""
    os.environ["TRITON_INTERPRET"] = "1"
    early = sorted(m for m in sys.modules if m.startswith(_KERNEL_PACKAGES))
    if early:
        raise RuntimeError(f"kernel modules {early} were imported before TRITON_INTERPRET=1 was "
                           f"set in this rank: import them inside the rank function")
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        if not name.startswith("triton._C"):
            del sys.modules[name]
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):
        raise RuntimeError(f"triton re-imported under TRITON_INTERPRET=1 but tl.sum is "
                           f"{type(tl.sum).__name__}, not an interpreted function")


class Interpreted:
    """A rank function that runs its kernels under the interpreter (:func:`interpret_in_this_rank`)
    and installs the shortcut first: ``run_ranks(Interpreted(worker), n,
    env=INTERPRETED_RANK_ENV, ...)`` (picklable: it holds a module-level function)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, rank: int, world: int, *args: Any) -> Any:
        interpret_in_this_rank()
        install()
        return self.fn(rank, world, *args)

    def __repr__(self) -> str:
        return f"Interpreted({self.fn.__module__}.{self.fn.__qualname__})"


"""Rank 0's view of a run: a tqdm progress bar with ETA in a terminal, plain lines otherwise.

``metrics.progress``:

=========  =====================================================================================
``auto``   ``bar`` when stdout is a terminal (``isatty()``), else ``lines``
``bar``    a tqdm bar on stdout (steps done, rate, ETA), its postfix updated every
           ``train.log_every`` steps with loss, grad norm and tokens/s; no per-step lines
``lines``  the ``format_step`` line every ``train.log_every`` steps through the run's ``log``
``off``    nothing
=========  =====================================================================================
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Literal, TextIO

Mode = Literal["bar", "lines", "off"]


def resolve_progress_mode(requested: str, stream: TextIO | None = None) -> Mode:
    """``auto`` -> ``bar`` if ``stream`` (default ``sys.stdout``) is a TTY else ``lines``;
    ``bar`` / ``lines`` / ``off`` as given; anything else raises ValueError naming it."""
    if requested == "auto":
        stream = sys.stdout if stream is None else stream
        isatty = getattr(stream, "isatty", None)
        return "bar" if isatty is not None and isatty() else "lines"
    if requested in ("bar", "lines", "off"):
        return requested  # type: ignore[return-value]
    raise ValueError(f"metrics.progress={requested!r}: expected auto, bar, lines or off")


class Progress:
    """The progress display of rank 0 (``mode`` from :func:`resolve_progress_mode`).

    Args:
        mode: ``bar``, ``lines`` or ``off``.
        total: steps of the run.  log_every: postfix refresh period (bar mode).
        log: the run's line printer (used by ``lines`` mode through :meth:`line_log`).
        stream: where the bar goes (default stdout).
    """

    def __init__(self, mode: Mode, total: int, log_every: int,
                 log: Callable[[str], None] | None, stream: TextIO | None = None) -> None:
        self.mode, self.total, self.log_every, self._log = mode, total, log_every, log
        self._bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True,
                             file=sys.stdout if stream is None else stream)

    def line_log(self) -> Callable[[str], None] | None:
        """The ``log`` the loop prints its per-step lines with: the run's in ``lines`` mode,
        None (no lines) for ``bar`` and ``off``."""
        return self._log if self.mode == "lines" else None

    def __call__(self, m: Any) -> None:
        """Advance by one step (``m``: its ``StepMetrics``)."""
        if self._bar is None:
            return
        if m.step % self.log_every == 0 or m.step == self.total:
            self._bar.set_postfix(loss=f"{m.loss:.4f}", grad_norm=f"{m.grad_norm:.3g}",
                                  tok_s=f"{m.tokens_per_s:,.0f}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

"""Communication with bounded waits: differentiable collectives and one point-to-point layer.

The only place in the runtime that talks to ``torch.distributed`` for data movement between
ranks of a group (the pipeline runtime's metadata exchange included, once switched): algorithms
(ring attention, the GDN state chain, the MoE dispatcher, the pipeline runtime) call these and
never touch process-group internals.

=====================  ==========================================================================
module                 what it holds
=====================  ==========================================================================
``handle``             :class:`AsyncHandle` (bounded, idempotent ``wait``; ``keep_alive``
                       buffers), :class:`CommTimeoutError`, :class:`CommFailedError`,
                       :data:`DEFAULT_TIMEOUT_S`, :func:`resolve_timeout`
``ranks``              :func:`group_rank`, :func:`group_size`, :func:`global_rank` (the one
                       group -> global rank conversion), :func:`check_device_backend`
``p2p``                :func:`isend`, :func:`irecv` (peers are ranks in the group),
                       :func:`ring_shift` (send to ``me + 1``, receive from ``me - 1``)
``collectives``        :func:`all_to_all_single` (async or not), :func:`all_gather`, :func:`attach`
                       (keeps a collective in a rank's backward); autograd
``agree``              :func:`check_ranks_agree` (the ranks compare a few values, e.g. shapes,
                       before a collective whose sizes depend on them; the same named error on
                       every rank instead of a size mismatch inside the backend)
=====================  ==========================================================================

May import: torch, torch.distributed and :mod:`overlap_runtime.platform`; nothing else of the
package (everything above ``ops`` imports this).
"""

from .agree import check_ranks_agree
from .collectives import all_gather, all_to_all_single, attach
from .handle import (
    DEFAULT_TIMEOUT_S,
    AsyncHandle,
    CommFailedError,
    CommTimeoutError,
    resolve_timeout,
)
from .p2p import irecv, isend, ring_shift
from .ranks import check_device_backend, global_rank, group_rank, group_size

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncHandle",
    "CommFailedError",
    "CommTimeoutError",
    "all_gather",
    "all_to_all_single",
    "attach",
    "check_device_backend",
    "check_ranks_agree",
    "global_rank",
    "group_rank",
    "group_size",
    "irecv",
    "isend",
    "resolve_timeout",
    "ring_shift",
]

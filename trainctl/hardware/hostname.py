"""The one name trainctl gives this host, in events, locks, logs and the lines it prints. No torch.

The short hostname (socket.gethostname()). torchrun names a host by socket.getfqdn(), which is "localhost"
on a machine whose /etc/hosts lists its name on 127.0.0.1's line after "localhost": `as_named` turns
torchrun's name of this host into ours, so one failure does not read "localhost" in one line and "vm" in the
next.
"""

from __future__ import annotations

import socket


def this_host() -> str:
    return socket.gethostname()


def as_named(reported: str) -> str:
    """`reported` (torchrun's name of a host), as trainctl names it: this host's fully qualified name is
    this_host(); any other host keeps its name."""
    return this_host() if reported in (this_host(), socket.getfqdn()) else reported

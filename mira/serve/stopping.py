"""uvicorn's server, whose first Ctrl-C (or SIGTERM) also ends the generations that run or wait.

uvicorn stops on a signal only once every connection has closed, so a long generation would hold
the server up to its last token; here its request ends at its next step instead, answered 503
(a stream: an error event), and the server exits.
"""

from __future__ import annotations

from types import FrameType

import uvicorn


class StoppingServer(uvicorn.Server):
    """Serves `config.app`, an app of mira.serve.app.create_app."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.config.app.state.stop_generating()
        super().handle_exit(sig, frame)

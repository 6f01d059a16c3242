"""`switchhead serve`: an OpenAI-compatible HTTP server with continuous batching over the runtime.

Needs the optional `serve` dependencies (FastAPI, uvicorn); see docs/SERVE.md.
"""

from switchhead.serve.scheduler import Job, Scheduler

__all__ = ["Job", "Scheduler", "ServeConfig", "create_app", "run_server"]


def __getattr__(name):
    # The HTTP layer imports FastAPI; keep `import switchhead.serve.scheduler` usable without it.
    if name in ("ServeConfig", "create_app"):
        from switchhead.serve import app

        return getattr(app, name)
    if name == "run_server":
        from switchhead.serve.server import run_server

        return run_server
    raise AttributeError(name)

"""What `switchhead serve` does, kept out of cli.py so the command stays a thin argument parser."""

from __future__ import annotations

import socket

from switchhead.errors import SwitchheadError, is_finite_number, is_int
from switchhead.serve.protocol import Limits


def check_options(port: int, max_batch: int, max_queue: int, timeout: float, max_prompt_tokens: int,
                  max_tokens: int) -> None:
    checks = [("port", port, 0, 65535), ("max-batch", max_batch, 1, None), ("max-queue", max_queue, 0, None),
              ("max-prompt-tokens", max_prompt_tokens, 1, None), ("max-tokens", max_tokens, 1, None)]
    for name, value, lo, hi in checks:
        if not is_int(value) or value < lo or hi is not None and value > hi:
            rule = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise SwitchheadError(f"--{name} must be an integer {rule}, got {value!r}")
    if not is_finite_number(timeout) or timeout < 0:
        raise SwitchheadError(f"--timeout must be a number of seconds >= 0 (0 = no limit), got {timeout!r}")


def check_address(host: str, port: int) -> None:
    """Can the server listen on host:port? Checked by binding (as uvicorn will, with SO_REUSEADDR) so that a port
    in use or an address this machine does not have is one line, instead of uvicorn's log and exit code 3."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:  # socket.gaierror included
        raise SwitchheadError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run_server(ckpt: str | None, onnx_dir: str | None, host: str, port: int, max_batch: int, max_queue: int,
               timeout: float, max_prompt_tokens: int, max_tokens: int, model_name: str | None = None,
               device: str | None = None, log_level: str = "info", threads: int | None = None) -> None:
    check_options(port, max_batch, max_queue, timeout, max_prompt_tokens, max_tokens)
    if model_name is not None and (not isinstance(model_name, str) or not model_name.strip()):
        raise SwitchheadError("--model-name is empty; give a name, or leave it out for the checkpoint's")
    try:
        import uvicorn

        from switchhead.serve.app import ServeConfig, create_app, default_model_name
    except ImportError as e:
        raise SwitchheadError(f"switchhead serve needs FastAPI and uvicorn ({e}); "
                              "install them with: pip install 'switchhead[serve]'") from None
    from switchhead.runtime.commands import load_generator

    check_address(host, port)  # before loading the model
    gen = load_generator(ckpt, device, onnx_dir, threads)
    config = ServeConfig(model_name=model_name or default_model_name(ckpt, onnx_dir), max_batch=max_batch,
                         max_queue=max_queue, timeout_s=timeout or None,
                         limits=Limits(max_prompt_tokens=max_prompt_tokens, max_tokens=max_tokens))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # On SIGTERM / Ctrl-C the requests in flight are answered with "server shutting down" (a stream gets
            # its error event) and their connections close; otherwise uvicorn waits for them, then cancels them
            # mid-stream with a logged traceback.
            self.config.app.state.scheduler.request_stop()
            super().handle_exit(sig, frame)

    app = create_app(gen, config)
    Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)).run()

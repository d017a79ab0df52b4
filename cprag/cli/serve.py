"""`cprag serve`: one model and key-shard cache answering questions over HTTP."""

from __future__ import annotations

from pathlib import Path

import typer

from cprag.cli.options import CHECKPOINT_OPTION, DEVICE_OPTION, DTYPE_OPTION, INDEX_OPTION
from cprag.cli.output import err, reports_errors


@reports_errors
def serve_command(
    index: Path = INDEX_OPTION,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; any but loopback needs --api-key."),
    port: int = typer.Option(8000, "--port"),
    api_key: str = typer.Option(None, "--api-key", envvar="CPRAG_API_KEY", show_envvar=True,
                                help="Key every route but /healthz asks for (Authorization: Bearer KEY)."),
    max_batch: int = typer.Option(16, "--max-batch", help="Questions decoded per backbone pass."),
    max_wait_ms: float = typer.Option(10.0, "--max-wait-ms", help="How long a request waits to batch with others."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds before a request gets 504."),
    checkpoint: Path = CHECKPOINT_OPTION,
    device: str = DEVICE_OPTION,
    dtype: str = DTYPE_OPTION,
):
    """Serve the index over HTTP: POST /v1/ask (?stream=true for server-sent events), POST /v1/ask_batch,
    GET /v1/info, GET /healthz, the web page at /, and OpenAPI docs at /docs. One model and key-shard cache serve
    every request, and concurrent questions are decoded together.

    Example: cprag serve --index indexes/demo --port 8000   (then open http://127.0.0.1:8000/)
    Example: CPRAG_API_KEY=... cprag serve --index indexes/demo --host 0.0.0.0
    """
    import ipaddress

    import uvicorn

    from cprag.api import Index
    from cprag.errors import ConfigError, IndexBusy, IndexUnfinished
    from cprag.serve import ServeConfig, create_app

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ConfigError("--host", host, "expected an IP address or localhost") from None
    if not loopback and not api_key:
        raise ConfigError("--host", host, "binding beyond this machine needs --api-key (or CPRAG_API_KEY)")
    if not 0 < port < 65536:
        raise ConfigError("--port", port, "must be between 1 and 65535")
    config = ServeConfig(max_batch=max_batch, max_wait_ms=max_wait_ms, timeout_s=timeout, api_key=api_key)
    server = create_app(index, lambda: Index(index, checkpoint=checkpoint, device=device, dtype=dtype), config)
    with err.status("loading the model and the index"):
        try:
            server.state.served.get()
        except (IndexBusy, IndexUnfinished) as failure:  # still being built: serve, answering 503 until it is ready
            err.print(f"[yellow]{failure}[/yellow]; answering 503 until it is ready")
    err.print(f"serving {index} on http://{host}:{port}/ (docs at /docs)")
    uvicorn.run(server, host=host, port=port, log_level="warning")

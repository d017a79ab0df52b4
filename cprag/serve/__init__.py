"""`cprag serve`: the HTTP API, request batching and the web page."""

from cprag.serve.app import ServeConfig, create_app

__all__ = ["ServeConfig", "create_app"]

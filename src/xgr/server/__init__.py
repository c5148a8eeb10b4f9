"""The HTTP API (FastAPI). Imported only by the CLI's ``serve``: the engine never imports it."""

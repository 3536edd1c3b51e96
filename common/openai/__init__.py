"""An OpenAI-compatible HTTP front for the verify service (`treespec openai`).

A separate process, a client of the Generation service like the SDK it is built on:
``/v1/chat/completions`` (the checkpoint's chat template), ``/v1/completions``,
``/v1/models``, ``/health`` and ``/metrics``, served by FastAPI on uvicorn. Each
module holds one idea:

    config.py     OpenAIConfig: what the process was told (one frozen dataclass)
    protocol.py   the request bodies (pydantic) and the response / chunk shapes
    translate.py  a request -> prompt token ids and the Generate call's arguments
    stream.py     one generation as text deltas, cut at stop strings
    errors.py     OpenAI's error JSON and the HTTP status of each failure
    metrics.py    the front's own /metrics
    app.py        the routes
    server.py     uvicorn: the listening line, SIGTERM, the verify connection
    cli.py        the subcommand's flags
"""

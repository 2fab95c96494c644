"""The OpenAI-compatible HTTP server: `kvfit serve MODEL`.

app.py (routes) -> async_engine.py (the engine thread) -> the LLMEngine; protocol.py is the wire
format, metrics.py the Prometheus registry, launch.py runs uvicorn with a graceful shutdown.
A body is prepared (parsed, validated, rendered, tokenized) by prepare.py on a thread, or, past
64 KiB, in a worker process of prepare_pool.py, so the server's GIL stays free for the others.
"""

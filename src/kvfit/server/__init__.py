"""The OpenAI-compatible HTTP server: `kvfit serve MODEL`.

app.py (routes) -> async_engine.py (the engine thread) -> the LLMEngine; protocol.py is the wire
format, metrics.py the Prometheus registry, launch.py runs uvicorn with a graceful shutdown.
"""

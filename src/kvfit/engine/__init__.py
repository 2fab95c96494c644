"""The engine: requests in, scheduling, tokens out."""

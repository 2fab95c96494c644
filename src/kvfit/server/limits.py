"""Server defaults, importable without fastapi (the CLI reads them for --help)."""

DEFAULT_MAX_BODY_BYTES = 1 << 20          # 1 MiB: far beyond any prompt max_model_len allows
DEFAULT_MAX_WAITING_REQUESTS = 1024

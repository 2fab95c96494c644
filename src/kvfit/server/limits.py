"""Server defaults, importable without fastapi (the CLI reads them for --help)."""

# request bodies: at least 1 MiB, and room for a prompt of max_model_len tokens written as JSON (a token id is at most
# 8 bytes with its separator; text runs 2-6 bytes a token, 12 for escaped CJK): 4 MiB at 131,072 tokens
MIN_MAX_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 32


def default_max_body_bytes(max_model_len: int) -> int:
    """The request body limit when --max-request-body-bytes is not given."""
    return max(MIN_MAX_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


DEFAULT_MAX_WAITING_REQUESTS = None       # kvfit serve: 16 x --max-num-seqs (commands/serve.py)
APP_MAX_WAITING_REQUESTS = 1024           # create_app's default, for an engine served in-process
# open connections (--max-connections; past it uvicorn answers 503). None: as many as the process's file
# descriptor limit allows (raised to its hard limit at start-up, as vLLM does), less RESERVED_FDS for the
# engine, the model files and the logs, so a burst of thousands of streams queues instead of being refused
DEFAULT_MAX_CONNECTIONS = None
RESERVED_FDS = 256
DEFAULT_HEADER_TIMEOUT_SECONDS = 10       # from connect (or the last response) to a complete request head
DEFAULT_BODY_TIMEOUT_SECONDS = 30         # from the request head to its last body byte (35 KB/s for 1 MiB, 140 for 4)
DEFAULT_KEEP_ALIVE_SECONDS = 5            # an idle keep-alive connection is closed after this
MAX_HEADER_BYTES = 16 * 1024              # a request head past this is a 431 (h11's own default, made explicit)
LINGER_SECONDS = 2.0                      # after a 431: how long the rest of the client's bytes are read and dropped
LINGER_BYTES = 1 << 20                    # ... and how many at most, before the connection closes
PUBLIC_MIN_PREFIX_CACHE_QUERY_TOKENS = 100_000   # an open /metrics shows the hit rate only past this many
API_KEY_ENV = "KVFIT_API_KEY"             # the API key, when neither --api-key nor --api-key-file is given
VLLM_API_KEY_ENV = "VLLM_API_KEY"          # read where KVFIT_API_KEY is not set (vLLM's name)

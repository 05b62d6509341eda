"""The embedded CPU inference server: SGLang's HTTP API (/generate, pause/continue, weight updates) over
a continuous-batching engine with a paged KV cache, so AReaL's own client path runs without a GPU."""

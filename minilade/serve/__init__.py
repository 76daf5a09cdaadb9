"""An OpenAI-compatible server whose concurrent requests share forward passes (python -m minilade.serve).

    __main__.py   command line, uvicorn, SIGTERM
    app.py        HTTP routes (Starlette): API key, body limit, errors, Server-Sent Events
    protocol.py   the request fields served, checked; the GenerationSettings they make
    responses.py  the OpenAI response and stream-chunk shapes, with usage and minilade's step statistics
    engine.py     one thread owns the model; each request's generation runs against a proxy of it
    batched.py    one forward pass over the rows of several generations, each with its own cache and mask
    prefill.py    a prompt's prefill from kept prefix rows (PrefixCache) and in chunks
    errors.py     the {"error": {...}} shape and its statuses
    metrics.py    counters for GET /metrics (Prometheus text)
"""

"""An OpenAI-compatible server whose concurrent requests share forward passes (python -m minilade.serve).

    __main__.py   command line, uvicorn, SIGTERM
    app.py        HTTP routes (Starlette): API key, body limit, errors, Server-Sent Events
    protocol.py   the request fields served, checked; the GenerationSettings they make
    responses.py  the OpenAI response and stream-chunk shapes, with usage and minilade's step statistics
    engine.py     one thread schedules the passes; each request's generation runs against a proxy of the model
    planner.py    what the generations of a pass feed it, for greedy auto to plan against
    batched.py    one forward pass over the rows of several generations, each with its own cache and mask
    stacked.py    the attention of a pass's causal calls of one shape as one kernel call, bits unchanged
    native_pass.py  the decoding calls of a pass as one native pass, where the model's steps are native
    compiled_pass.py, cache_pool.py  the decoding calls of a pass in compiled passes, where its steps are compiled
    prefill.py    a prompt's prefill from kept prefix rows (PrefixCache) and in chunks
    errors.py     the {"error": {...}} shape and its statuses
    metrics.py    counters for GET /metrics (Prometheus text)
"""

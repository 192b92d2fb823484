"""OpenAI-compatible HTTP server (``omnistage serve``).

Modules: ``protocol`` (wire models), ``errors`` (OpenAI error bodies),
``media`` (the server's bounds on ``omnistage.multimodal.media``, its errors
as 400s), ``engine_client`` (the engine thread and its asyncio bridge),
``serving_chat`` / ``serving_completions`` (the two generation endpoints) with
``serving_common`` (what they share: sampling parameters, usage, SSE, client
disconnects), ``metrics`` (Prometheus text), ``api_server`` (the FastAPI app)
and ``cli_args`` (``omnistage serve``).

Importing this package does not import FastAPI or the engine; import
``api_server.build_app`` for that.
"""

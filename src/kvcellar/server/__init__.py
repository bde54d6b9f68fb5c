"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

``app.create_app(engine, settings)`` builds the ASGI app; ``runner.serve`` runs it for
``kvcellar serve``. Nothing is imported here so that the CLI can load ``server.cli`` cheaply.
"""

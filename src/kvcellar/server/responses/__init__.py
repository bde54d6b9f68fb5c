"""The OpenAI Responses API (``POST /v1/responses``, ``/v1/responses/input_tokens``): Codex CLI
and the openai-agents SDK speak only this. ``protocol`` holds the wire types, ``adapter`` turns
a request into the internal one, ``render`` writes the engine's events as a response object or
its event stream, ``store`` keeps recent responses for ``previous_response_id``."""

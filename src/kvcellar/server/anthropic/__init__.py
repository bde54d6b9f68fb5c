"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): Claude
Code speaks only this. ``protocol`` holds the wire types, ``adapter`` turns a request into the
internal one, ``render`` writes the engine's events as a message or its event stream."""

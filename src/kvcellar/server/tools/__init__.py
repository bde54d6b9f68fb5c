"""Tool calling: rendering tool definitions into prompts, the grammars that force valid calls,
and the per-family parsers that turn model output into OpenAI ``tool_calls``."""

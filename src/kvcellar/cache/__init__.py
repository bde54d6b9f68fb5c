"""The prefix cache: chained block digests, the RAM tier's block manager, KV namespaces."""

"""kvcellar: an OpenAI-compatible LLM server whose prompt KV cache is persistent and tiered.

Importing the package first sets the OpenMP wait policy: torch's default spinning OpenMP
threads make decode ~30x slower whenever another process is busy (measured on 2 cores).
The variable is read once, when the OpenMP runtime loads, so this must run before torch.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# transformers must never reach for the network at run time; models come from local files
# or the local HF cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"

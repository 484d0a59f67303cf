"""One rung of the torchlet ladder: `llm.py` says what this rung adds and why."""

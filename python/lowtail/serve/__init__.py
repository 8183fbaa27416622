"""The pinned inference worker: its process and child, engine, model, pinning, per-call statistics."""

"""Ray actors: the per-node lease allocator, the inference actor and its clients, metrics, the demo."""

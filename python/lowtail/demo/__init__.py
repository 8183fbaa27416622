"""Demos that drive a deployed cluster (the sandbox of ``make demo``) rather than a Ray of their own."""

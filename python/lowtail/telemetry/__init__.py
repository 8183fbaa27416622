"""Exports under the predecessor system's names: TensorBoard and Prometheus, and reading them back."""

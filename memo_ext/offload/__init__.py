"""offload."""

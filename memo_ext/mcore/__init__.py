"""mcore."""

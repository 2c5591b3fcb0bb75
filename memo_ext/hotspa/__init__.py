"""hotspa."""

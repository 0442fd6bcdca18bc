"""Architecture adapters: one per MoE family, and the registry that picks one from a config."""

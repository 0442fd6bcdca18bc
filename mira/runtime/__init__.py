"""The runtime: the module that replaces transformers' experts, the transfer layer, and the engine."""

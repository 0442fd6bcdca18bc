"""The expert cache: slots, budget, telemetry (mechanism) and residency policies (policy)."""
